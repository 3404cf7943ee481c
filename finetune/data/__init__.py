"""Instruct data: rows -> conversations (formats) -> chat templates (template) -> inference-exact labels (labels) ->
ordered, packed samples of one source or a mixture (stream) -> batches (collate)."""

from .collate import batch_efficiency, format_preview, pad_collate
from .formats import FORMATS, Conversation, DataError, Rows, detect_format, load_rows, row_of, to_conversation
from .labels import DROP_REASONS, IGNORE_INDEX, Labelled, prompt_text, tokenize_messages
from .stream import SampleStream, build_samples, describe_counts, mixture_sizes, open_sources
from .template import Unsupported, read_chat_template, require_chat_template

__all__ = ["DROP_REASONS", "FORMATS", "IGNORE_INDEX", "Conversation", "DataError", "Labelled", "Rows", "SampleStream",
           "Unsupported", "batch_efficiency", "build_samples", "describe_counts", "detect_format", "format_preview",
           "load_rows", "mixture_sizes", "open_sources", "pad_collate", "prompt_text", "read_chat_template",
           "require_chat_template", "row_of", "to_conversation", "tokenize_messages"]
