"""The scripted chat models' outputs (chat_model_path and harmony_scripted_path of
tests/e2e/conftest.py) and the request extra that turns thinking off."""

from __future__ import annotations

from tests.support.bpe import byte_ids

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

TWO_CALLS = (
    "I should look both up.</think>\n\nOne moment.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
BARE_CALL = ("Checking.</think>\n\nSure thing\n"
             "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>")
# Content ending in a proper prefix of `<function=`: the tool parser holds it to the end, so
# the entry of "function" is labelled only then and rides on the finish chunk (rule 5).
HELD = "Checking.</think>\n\nCall <function"
# Meant for enable_thinking false + tool_choice "none": markers inside content stay text.
RULE6 = ' Plain </think> text\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> done.'


def chat_scripts(tok) -> dict[str, list[int]]:
    """Trigger (found in the prompt) -> the output ids of `chat_model_path`."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return {
        "[two-calls]": enc(TWO_CALLS),
        "[bare-call]": enc(BARE_CALL),
        "[held]": enc(HELD),
        "[rule6]": enc(RULE6),
        # The emoji as four one-byte tokens: a character split across tokens.
        "[emoji]": [*enc("Thinking.</think>\n\nHot "), *byte_ids(tok, "🙂"),
                    *enc(" day. Nice weather today.")],
    }


HARMONY_SCRIPTS = [
    {"trigger": "weather", "text": "<|channel|>analysis<|message|>Need the weather.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": "Paris"}<|call|>'},
    {"trigger": None, "text": "<|channel|>analysis<|message|>Let me think.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Use a <b> tag."},
]
