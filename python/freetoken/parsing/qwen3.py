"""Qwen3 reasoning: ``<think>`` ... ``</think>``."""

from __future__ import annotations

from freetoken.parsing.stage import Label, Stage, find_first, partial_suffix_len


class ThinkSplitter(Stage):
    """``<think>`` ... ``</think>`` (Qwen3).

    - ``<think>`` opens reasoning only as the very first text of the output; later
      it is plain text. With ``force_reasoning`` the template already opened the
      block, and a leading ``<think>`` is dropped.
    - ``</think>`` ends reasoning; ``<tool_call>`` met while reasoning also ends it
      and stays in content for the tool parser.
    - Reasoning is stripped at both ends; content right after ``</think>`` loses its
      leading whitespace. Content is otherwise verbatim and nothing in it is held.
    """

    START, END, TOOL = "<think>", "</think>", "<tool_call>"
    MARKERS = (START, END, TOOL)
    leftover = Label.HIDDEN  # trailing whitespace of reasoning cut off by the end
    strip_head = False  # drop the output's leading whitespace (GLM-4.5 writes "\n<think>")

    def __init__(self, force_reasoning: bool) -> None:
        super().__init__()
        self._at_head = True
        self._in_reasoning = force_reasoning
        self._strip = force_reasoning

    def _run(self, final: bool) -> None:
        if self._at_head:
            if self.strip_head:
                text = self.tape.text
                if not text.strip() and not final:
                    return
                self._consume(len(text) - len(text.lstrip()), Label.HIDDEN)
            if self.tape.text.startswith(self.START):
                self._consume(len(self.START), Label.MARKER)
                self._in_reasoning = self._strip = True
            elif self.START.startswith(self.tape.text) and not final:
                return
            self._at_head = False
        if self._in_reasoning:
            self._run_reasoning(final)
        if not self._in_reasoning:
            self._emit(len(self.tape.text), Label.CONTENT)

    def _run_reasoning(self, final: bool) -> None:
        buf = self.tape.text
        i, marker = find_first(buf, (self.END, self.TOOL))
        if marker is not None:
            body = len(buf[:i].rstrip())
            self._emit(body, Label.REASONING)
            self._consume(i - body, Label.HIDDEN)
            self._in_reasoning = False
            # The tool call itself is content; only </think> is swallowed.
            self._strip = marker == self.END
            if marker == self.END:
                self._consume(len(self.END), Label.MARKER)
            return
        keep = 0 if final else partial_suffix_len(buf, (self.END, self.TOOL))
        # Trailing whitespace waits too: it is dropped if reasoning ends right after it.
        self._emit(len(buf[: len(buf) - keep].rstrip()), Label.REASONING)
