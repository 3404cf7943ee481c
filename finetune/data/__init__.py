"""Instruct data: rows -> conversations (formats) -> chat templates (template) -> inference-exact labels (labels) ->
ordered, packed samples of one source or a mixture (stream) -> batches (collate)."""
# The package's API, re-exported:
from .collate import pad_collate  # noqa: F401
from .formats import Conversation, DataError, detect_format, load_rows, row_of, to_conversation  # noqa: F401
from .labels import IGNORE_INDEX, tokenize_messages  # noqa: F401
from .stream import build_samples, describe_counts, open_sources  # noqa: F401
from .template import require_chat_template  # noqa: F401
