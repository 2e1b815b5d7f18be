"""Hugging Face Hub names: a value that is not a local path but a Hub id (`org/name`) becomes the local directory
of its snapshot in the Hugging Face cache, downloaded there when it is absent and the Hub can be reached.

    value exists on disk            -> that path, as given (a local path stays a local path)
    value is no valid Hub id        -> that path, as given (the caller names the missing file or directory)
    otherwise                       -> huggingface_hub.snapshot_download(value, revision, allow_patterns):
                                       <cache>/<repo_type>s--org--name/snapshots/<commit>

Offline (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE` set to 1), or with `local_only`, nothing is fetched: the
snapshot of the revision's commit (refs/<revision> names it) must already be in the cache. Every failure is one
ConfigError sentence naming the field, the value and both ways out (a local directory, or the Hub). Which ranks
download first is the caller's business (`parallel/dist.py` `local_main_first`); this module does no
collective. Resolved snapshots are remembered per process, so the readers of a run (config checks, tokenizer,
weights) ask the Hub once.

Used for models and tokenizers (isotrain/models/loading.py) and for `repo_type="dataset"`.
"""

from __future__ import annotations

import os
from pathlib import Path

from isotrain.errors import ConfigError

# What a model directory needs, by purpose. The weights are the safetensors files only (isotrain reads nothing
# else); *.bin/*.pth/*.h5/*.msgpack/*.onnx/*.gguf copies of the same weights are never fetched.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "*.tiktoken", "spiece.model", "tokenizer.model", "chat_template.*")
WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json")
MODEL_FILES = (*CONFIG_FILES, *TOKENIZER_FILES, *WEIGHT_FILES)

_TRUE = {"1", "ON", "YES", "TRUE"}

# (repo_type, repo_id, revision, cache) -> (snapshot directory, the patterns fetched into it; None: every file)
_resolved: dict[tuple, tuple[Path, frozenset | None]] = {}


def offline_variable() -> str | None:
    """The offline variable that is set (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE`), or None. Read at each call:
    huggingface_hub reads it once, when it is imported, which may be before a test or a launcher sets it."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in _TRUE:
            return name
    return None


def hub_cache_dir() -> Path:
    """The Hugging Face cache, read from the environment now, with huggingface_hub's precedence:
    HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def is_hub_id(value: str) -> bool:
    """Whether `value` reads as a Hub id (`name` or `org/name`) rather than a path: it does not exist on disk and
    huggingface_hub accepts it as a repo id (so `./x`, `/abs/x` and `a/b/c` are paths)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(value).exists() or value.startswith((".", "~")):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def resolve(value: str, revision: str | None = None, *, field: str, revision_field: str | None = None,
            repo_type: str = "model", allow_patterns: tuple[str, ...] | None = MODEL_FILES,
            local_only: bool = False) -> Path:
    """The local directory `value` names: the path itself, or the snapshot of Hub id `value` at `revision`
    (default: main) holding the files that `allow_patterns` match (None: every file of the repository).

    `field` / `revision_field` are the config names shown in errors (e.g. "model.name_or_path",
    "model.revision"). `local_only`: use the cache only, as offline mode does (a rank whose machine's first rank
    already downloaded)."""
    if not is_hub_id(value):
        if revision is not None:
            raise ConfigError(f"{revision_field or 'revision'}={revision!r} selects a version of a Hugging Face Hub "
                              f"repository, but {field}={value!r} is a local path; remove "
                              f"{revision_field or 'the revision'} or give a Hub id")
        return Path(value)
    cache = hub_cache_dir()
    key = (repo_type, value, revision or "main", str(cache))
    known = _resolved.get(key)
    wanted = None if allow_patterns is None else frozenset(allow_patterns)
    if known is not None and (known[1] is None or (wanted is not None and wanted <= known[1])):
        return known[0]
    local_only = local_only or offline_variable() is not None
    directory = _snapshot(value, revision, repo_type, allow_patterns, cache, local_only, field, revision_field)
    _resolved[key] = (directory, None if wanted is None else wanted | (known[1] if known else frozenset()))
    return directory


def _snapshot(repo_id: str, revision: str | None, repo_type: str, allow_patterns, cache: Path, local_only: bool,
              field: str, revision_field: str | None) -> Path:
    """huggingface_hub.snapshot_download, each of its failures as one sentence."""
    from huggingface_hub import errors, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # A cached snapshot known to miss files: huggingface_hub >= 1.x tells it apart; before, it is "not cached".
    IncompleteSnapshotError = getattr(errors, "IncompleteSnapshotError", ())  # noqa: N806

    at = f" at revision {revision!r}" if revision is not None else ""
    named = f"{field}={repo_id!r} is not a local directory"
    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                      allow_patterns=list(allow_patterns) if allow_patterns else None,
                                      local_files_only=local_only))
    except RevisionNotFoundError:
        raise ConfigError(f"{revision_field or 'revision'}={revision!r} is not a branch, tag or commit of "
                          f"{repo_id!r} on the Hugging Face Hub; give one that exists, e.g. main") from None
    except GatedRepoError:
        raise ConfigError(f"{named}, and {repo_id!r} is a gated repository on the Hugging Face Hub that this "
                          f"machine has no access to; accept its terms on huggingface.co and log in (hf auth login), "
                          f"or give a local {kind} directory") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{named}, and the Hugging Face Hub has no {kind} repository {repo_id!r} that this "
                          f"machine may read; fix the path or the id (a private repository needs hf auth login)") \
            from None
    except IncompleteSnapshotError:
        raise ConfigError(f"{named}, and its copy in the Hugging Face cache ({cache}){at} lacks files that the Hub "
                          f"could not be asked for now; run once with network access to complete it, or give a local "
                          f"{kind} directory") from None
    except LocalEntryNotFoundError as err:
        variable = offline_variable()
        if variable is not None:
            why = f"while {variable}=1"
        elif local_only:
            why = "and this rank reads the cache only"
        else:
            why = f"and the Hugging Face Hub could not be reached ({type(err.__cause__ or err).__name__})"
        raise ConfigError(f"{named} and is not in the Hugging Face cache ({cache}){at} {why}; give a local {kind} "
                          f"directory, or run once with network access to download it into that cache") from None
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", "an error")
        raise ConfigError(f"{named}, and the Hugging Face Hub answered {status} for {repo_id!r}; give a local "
                          f"{kind} directory or try again later") from None


def forget_resolved() -> None:
    """Forget the snapshots resolved in this process (tests that swap caches)."""
    _resolved.clear()
