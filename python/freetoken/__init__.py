"""FreeToken: a compact OpenAI-compatible LLM server with its own torch engine."""

from freetoken.core import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Importing the engine pulls in torch; keep `import freetoken` cheap for the CLI.
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    raise AttributeError(name)
