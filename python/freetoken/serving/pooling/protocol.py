"""The scoring and pooling endpoints' requests: /rerank (Cohere / Jina), /score and
/generative_scoring (vLLM) and /v1/embeddings (OpenAI). Pydantic at the edge, as protocol.py's:
each request checks itself as it is parsed and refuses, naming the field, what it would
otherwise have to ignore."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import StrictBool, StrictInt, StrictStr, model_validator

from freetoken.serving.errors import RequestError
from freetoken.serving.openai.labels import LabelSet, label_set
from freetoken.serving.limits import Limits
from freetoken.serving.openai.messages import OpenAIBaseModel

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


@dataclass(frozen=True)
class ScoringJob:
    """A /generative_scoring request as the engine runs it."""

    prompts: list[list[int]]
    labels: LabelSet
    apply_softmax: bool
    length_normalize: bool


class GenerativeScoringRequest(OpenAIBaseModel):
    """vLLM's /generative_scoring: each item joined to the query (after it, or before it with
    `item_first`) is a prompt, scored on `label_token_ids`; ours also takes `labels` of any
    length (strings or id lists) and `length_normalize`."""

    model: str | None = None
    query: StrictStr | list[StrictInt]
    items: list[StrictStr] | list[list[StrictInt]]
    label_token_ids: list[StrictInt] | None = None
    labels: list[StrictStr] | list[list[StrictInt]] | None = None
    apply_softmax: StrictBool = True
    item_first: StrictBool = False
    add_special_tokens: StrictBool = True  # the query's; items never get them (vLLM's)
    length_normalize: StrictBool = False

    @model_validator(mode="after")
    def _check(self) -> GenerativeScoringRequest:
        _refuse_unknown(self)
        if not self.items:
            raise RequestError("items must not be empty", param="items")
        if (self.label_token_ids is None) == (self.labels is None):
            raise RequestError("give exactly one of label_token_ids or labels", param="labels")
        return self

    def to_job(self, tokenizer, limits: Limits) -> ScoringJob:
        """Tokenized and checked against the server (vocabulary, caps)."""
        if len(self.items) > limits.max_prompts_per_request:
            raise RequestError(f"A request may carry at most {limits.max_prompts_per_request} "
                               f"items; this one has {len(self.items)}.", param="items")
        query = self.query if isinstance(self.query, list) else tokenizer.encode(
            self.query, add_special_tokens=self.add_special_tokens)
        limits.check_ids(query, "query")
        prompts = []
        for item in self.items:
            ids = item if isinstance(item, list) else tokenizer.encode(item,
                                                                       add_special_tokens=False)
            limits.check_ids(ids, "items")
            prompt = ids + query if self.item_first else query + ids
            if not prompt:
                raise RequestError("A prompt (query and item) is empty", param="items")
            prompts.append(prompt)
        if self.labels is not None:
            labels = label_set(tokenizer, list(self.labels), limits, "labels")
        else:
            labels = label_set(tokenizer, [[t] for t in self.label_token_ids], limits,
                               "label_token_ids")
        return ScoringJob(prompts, labels, self.apply_softmax, self.length_normalize)


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
