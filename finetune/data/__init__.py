"""Instruct data: rows -> conversations (formats) -> inference-exact labels (labels) -> ordered, packed samples
(stream) -> batches (collate)."""

from .collate import batch_efficiency, format_preview, pad_collate
from .formats import (FORMATS, Conversation, DataError, columns_of, detect_format, load_rows, to_conversation,
                      to_messages)
from .labels import DROP_REASONS, IGNORE_INDEX, Unsupported, prompt_text, tokenize_messages
from .stream import SampleStream, build_samples

__all__ = ["DROP_REASONS", "FORMATS", "IGNORE_INDEX", "Conversation", "DataError", "SampleStream", "Unsupported",
           "batch_efficiency", "build_samples", "columns_of", "detect_format", "format_preview", "load_rows",
           "pad_collate", "prompt_text", "to_conversation", "to_messages", "tokenize_messages"]
