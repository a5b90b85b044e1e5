"""The pooling endpoints' requests: /rerank (Cohere / Jina), /score (vLLM) and /v1/embeddings
(OpenAI). Pydantic at the edge, as protocol.py's: each request checks itself as it is parsed and
refuses, naming the field, what it would otherwise have to ignore."""

from __future__ import annotations

from typing import Literal

from pydantic import StrictBool, StrictInt, StrictStr, model_validator

from freetoken.serving.errors import RequestError
from freetoken.serving.messages import OpenAIBaseModel

# Fields that cannot change a score or an embedding.
_HARMLESS = {"user", "request_id", "priority", "metadata", "encoding_format"}


def _refuse_unknown(request: OpenAIBaseModel) -> None:
    for name, value in (request.model_extra or {}).items():
        if name not in _HARMLESS and value is not None:
            raise RequestError(f"Unknown field {name!r}: refused rather than ignored", param=name)


class Document(OpenAIBaseModel):
    text: StrictStr


class RerankRequest(OpenAIBaseModel):
    """Cohere's and Jina's shape, as vLLM serves it at /rerank, /v1/rerank and /v2/rerank."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | Document]
    top_n: StrictInt | None = None  # None: every document
    return_documents: StrictBool = True

    @model_validator(mode="after")
    def _check(self) -> RerankRequest:
        _refuse_unknown(self)
        if not self.documents:
            raise RequestError("documents must not be empty", param="documents")
        if self.top_n is not None and self.top_n < 1:
            raise RequestError(f"top_n must be at least 1, got {self.top_n}.", param="top_n")
        return self

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(OpenAIBaseModel):
    """vLLM's /score: `text_1` against each `text_2` (one to one, or one to many)."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        _refuse_unknown(self)
        for name in ("text_1", "text_2"):
            if getattr(self, name) == []:
                raise RequestError(f"{name} must not be empty", param=name)
        firsts, seconds = self._lists()
        if len(firsts) not in (1, len(seconds)):
            raise RequestError(f"text_1 must be one text or as many as text_2 ({len(seconds)}), "
                               f"got {len(firsts)}.", param="text_1")
        return self

    def _lists(self) -> tuple[list[str], list[str]]:
        as_list = lambda v: [v] if isinstance(v, str) else list(v)  # noqa: E731
        return as_list(self.text_1), as_list(self.text_2)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        firsts, seconds = self._lists()
        return list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's /v1/embeddings."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        _refuse_unknown(self)
        inputs = self.inputs
        if not inputs or any(len(i) == 0 for i in inputs):
            raise RequestError("input must not be empty, nor hold an empty input", param="input")
        if self.dimensions is not None and self.dimensions < 1:
            raise RequestError(f"dimensions must be at least 1, got {self.dimensions}.",
                               param="dimensions")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input as a string or an id list (a flat id list is one input)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]
        return list(value)
