"""Models by name: `OWNER/REPO[:QUANT]` or `hf://OWNER/REPO[:QUANT]` resolved to a GGUF file through
`huggingface_hub`, as llama-server's `-hf` does.

The file is the repository's GGUF whose name carries the quant tag (default Q4_K_M, else the only GGUF; a
split GGUF counts as one, and all its parts are fetched), downloaded into the standard Hugging Face cache
(resumable, with a progress bar, `HF_TOKEN` honoured), with an `mmproj*.gguf` beside it when the repository
has one. With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the cached snapshot is used instead.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from hf2q.checkpoint.gguf_file import SPLIT_PART, split_part_names

log = logging.getLogger("hf2q.hub")

DEFAULT_QUANT = "Q4_K_M"
_SCHEME = "hf://"
_REFERENCE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?$")


class HubError(ValueError):
    """A model name that cannot be resolved; the message says why and what exists."""


@dataclass(frozen=True)
class HubReference:
    repo_id: str
    quant: str | None  # None: the default tag, else the only GGUF


@dataclass(frozen=True)
class HubModel:
    gguf: Path
    mmproj: Path | None


def parse_reference(text: str) -> HubReference | None:
    """The Hub reference `text` names, or None when it is a local path (an existing file, or not in the
    OWNER/REPO[:QUANT] form without an `hf://` prefix)."""
    explicit = text.startswith(_SCHEME)
    body = text[len(_SCHEME):] if explicit else text
    if not explicit and (Path(text).exists() or text.lower().endswith(".gguf")):
        return None
    match = _REFERENCE.match(body)
    if match is None:
        if explicit:
            raise HubError(f"{text!r} is not a Hugging Face model name: use hf://OWNER/REPO[:QUANT]")
        return None
    return HubReference(match["repo"], match["quant"])


def model_files(names: list[str]) -> list[str]:
    """The GGUF files of a repository listing that hold a model (projectors left out)."""
    return sorted(n for n in names if n.lower().endswith(".gguf") and not _is_mmproj(n))


def choose_gguf(names: list[str], quant: str | None, repo_id: str) -> str:
    """The one model GGUF of `names` for the quant tag (a split GGUF's first part); HubError listing the GGUFs
    when none or several match."""
    ggufs = model_files(names)
    if not ggufs:
        raise HubError(f"{repo_id} holds no GGUF model file")
    models = sorted({_model_of(n) for n in ggufs})
    matches = [m for m in models if _has_tag(m, quant or DEFAULT_QUANT)]
    if not matches and quant is None and len(models) == 1:
        matches = models
    if len(matches) != 1:
        tag = quant or f"{DEFAULT_QUANT} (the default)"
        what = "matches no" if not matches else "matches more than one"
        raise HubError(f"{repo_id}: quant tag {tag} {what} GGUF file; the repository holds: {', '.join(ggufs)} "
                       f"(name one with {repo_id}:TAG)")
    parts = model_parts(names, matches[0])
    return parts[0]


def model_parts(names: list[str], model: str) -> list[str]:
    """The files of the model GGUF `model` (a file, or any part of a split GGUF): all its parts, first first;
    HubError when a split GGUF misses some."""
    parts = sorted(n for n in model_files(names) if _model_of(n) == _model_of(model))
    if not parts or SPLIT_PART.search(parts[0]) is None:
        return [model]
    expected = split_part_names(parts[0])
    missing = [n for n in expected if n not in parts]
    if missing:
        raise HubError(f"split GGUF {_model_of(model)} is incomplete: {', '.join(missing)} missing")
    return expected


def choose_mmproj(names: list[str], gguf: str) -> str | None:
    """The multimodal projector beside `gguf` (same folder), preferring one whose name shares its quant."""
    folder = gguf.rpartition("/")[0]
    beside = sorted(n for n in names if n.lower().endswith(".gguf") and _is_mmproj(n)
                    and n.rpartition("/")[0] == folder)
    return beside[0] if beside else None


def resolve(ref: HubReference, projector: bool = True) -> HubModel:
    """Download (or find in the cache) the GGUF `ref` names and, unless `projector` is false, its projector."""
    from huggingface_hub import hf_hub_download

    names, offline = _listing(ref.repo_id)
    gguf = choose_gguf(names, ref.quant, ref.repo_id)
    mmproj = choose_mmproj(names, gguf) if projector else None
    paths = []
    for name in [*model_parts(names, gguf), *([mmproj] if mmproj else [])]:
        log.info("%s %s from %s", "using cached" if offline else "fetching", name, ref.repo_id)
        paths.append(Path(hf_hub_download(ref.repo_id, name, local_files_only=offline)))
    return HubModel(paths[0], paths[-1] if mmproj else None)  # the parts of a split GGUF land side by side


def local_model_path(name: str, projector: bool = True) -> Path:
    """The local GGUF file a `--model` value names: a path as given, or a Hub model fetched into the cache, with
    the repository's projector beside it unless `projector` is false (text only, or another projector named)."""
    ref = parse_reference(name)
    if ref is None:
        return Path(name)
    found = resolve(ref, projector)
    if found.mmproj is not None:
        log.info("fetched the projector %s beside the model", found.mmproj.name)
    return found.gguf


def _listing(repo_id: str) -> tuple[list[str], bool]:
    """(file names of the repository, whether they come from the local cache because the Hub is unreachable
    or offline mode is on)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if not constants.HF_HUB_OFFLINE:
        try:
            info = HfApi().model_info(repo_id)
            return [s.rfilename for s in info.siblings or []], False
        except RepositoryNotFoundError:
            raise HubError(f"{repo_id} is not a model repository on {constants.ENDPOINT} (or it needs HF_TOKEN)") \
                from None
        except HfHubHTTPError as exc:  # the Hub answered, with an error: not a reason to use a stale cache
            status = exc.response.status_code if exc.response is not None else "an error"
            raise HubError(f"{constants.ENDPOINT} answered {status} when listing {repo_id}") from None
        except Exception as exc:  # connection refused, DNS, timeouts: try the cache
            if not _is_network_error(exc):
                raise
            log.warning("the Hub is unreachable (%s); looking for %s in the local cache", type(exc).__name__, repo_id)
    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise HubError(f"{repo_id} is not in the local Hugging Face cache and the Hub cannot be reached "
                       f"(offline mode, or no network)") from None
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()], True


def _is_network_error(exc: Exception) -> bool:
    """A failure to reach the Hub (not an answer from it), whichever HTTP library huggingface_hub uses."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(exc, (OfflineModeIsEnabled, OSError)):
        return True
    return any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)


def _is_mmproj(name: str) -> bool:
    return name.rpartition("/")[2].lower().startswith("mmproj")


def _model_of(name: str) -> str:
    """The model a GGUF file name belongs to: the name itself, or a split GGUF's name without the part."""
    return SPLIT_PART.sub(".gguf", name)


def _has_tag(name: str, tag: str) -> bool:
    """Whether the file name carries the quant tag as a whole word (Q4_K does not match Q4_K_M)."""
    stem = _model_of(name).rpartition("/")[2]
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    return re.search(rf"(?:^|[-._]){re.escape(tag)}(?:$|[-.])", stem, re.IGNORECASE) is not None
