"""What every route needs: the loaded model, the running engine, the server's settings and metrics."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hf2q.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from hf2q.server.errors import APIError
from hf2q.server.media import MediaPolicy
from hf2q.server.metrics import Metrics
from hf2q.vision.preprocess import ImageProcessing


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    is_demo: bool = False
    api_key: Optional[str] = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 4096
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from ("*" for any); none by default
    metrics_public: bool = False  # /metrics without the API key, for scrapers that send none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    prefix_cache: bool = True  # the engine retains prefixes: chat requests then find their turn anchor
    prefix_rerender: bool = True  # and, after an answer, prefill the history as the next user turn renders it
    media: MediaPolicy = MediaPolicy()  # where image_url parts may come from, and how large they may be
    # what a request that leaves a sampling field out gets (server/sampling.py: the model's recommended values)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerState:
    model: Any                    # hf2q.model.Model
    engine: Any                   # hf2q.engine.async_engine.AsyncEngine
    config: ServerConfig
    scripted_replies: Optional[list[list[int]]] = None  # testing aid, see `--scripted-replies`
    vision: Optional[ImageProcessing] = None  # the vision tower's preprocessing; None: no projector loaded
    metrics: Metrics = None       # type: ignore[assignment]
    created: int = field(default_factory=lambda: int(time.time()))
    _script_index: Any = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(self.config.model_name)

    def check_model(self, name: Optional[str]) -> None:
        """An empty or absent `model` means the served one; any other unknown name is a 404."""
        if name and name != self.config.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")

    def next_script(self) -> Optional[list[int]]:
        """The scripted reply for the next generation (round robin), or None when not scripting."""
        if not self.scripted_replies:
            return None
        return list(self.scripted_replies[next(self._script_index) % len(self.scripted_replies)])
