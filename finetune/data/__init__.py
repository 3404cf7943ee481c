"""Instruct data: rows -> conversations (formats) -> chat templates (template) -> inference-exact labels (labels) ->
ordered, packed samples of one source or a mixture (stream) -> batches (collate)."""

from .collate import pad_collate
from .formats import Conversation, DataError, detect_format, load_rows, row_of, to_conversation
from .labels import IGNORE_INDEX, tokenize_messages
from .stream import build_samples, describe_counts, open_sources
from .template import read_chat_template, require_chat_template

__all__ = ["IGNORE_INDEX", "Conversation", "DataError", "build_samples", "describe_counts", "detect_format",
           "load_rows", "open_sources", "pad_collate", "read_chat_template", "require_chat_template", "row_of",
           "to_conversation", "tokenize_messages"]
