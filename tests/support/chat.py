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
# GLM-4.5's turn as its template writes one (parsed with --reasoning-parser/--tool-call-parser
# glm45), and Mistral's v11+ calls (--tool-call-parser mistral); on this vocabulary their tags
# are plain text.
GLM45 = ("\n<think>I need the weather.</think>\nOne moment.\n<tool_call>get_weather\n"
         "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
         "<arg_value>3</arg_value>\n</tool_call>")
MISTRAL = ('Checking.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
           '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')
# Granite 3.x's calls (--tool-call-parser granite) and Phi-4-mini's (phi4_mini_json): an opener,
# then a JSON list of calls; here <|tool_call|> is plain text too.
GRANITE = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}}]')
PHI4_MINI = 'Checking.\nfunctools[{"name": "get_time", "arguments": {"zone": "CET"}}]'
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
        "[glm45]": enc(GLM45),
        "[mistral]": enc(MISTRAL),
        "[granite]": enc(GRANITE),
        "[phi4_mini]": enc(PHI4_MINI),
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
