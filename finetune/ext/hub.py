"""Before torch is imported: hub ids in the config while the Hugging Face hub cannot be reached stop in one line
(huggingface_hub would retry for ~30 s)."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from ..args import remote_paths
from ..config import Config, ConfigError


def probe(cfg: Config) -> None:
    """A ConfigError naming the first hub id when the hub cannot be reached (no proxy set, HF_HUB_OFFLINE unset)."""
    remote = remote_paths(cfg)
    proxy = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not remote or proxy or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError:
        key, value = next(iter(remote.items()))
        raise ConfigError(f"{key} '{value}' is not a local path and the Hugging Face hub ({url.netloc}) cannot be "
                          f"reached: pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache") from None
