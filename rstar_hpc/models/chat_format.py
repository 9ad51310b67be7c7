"""The rStar2-Agent conversation format (rStar2-Agent paper §2.1, Fig. 3; microsoft/rStar
rstar2_agent/config/rstar2_agent_trainer.yaml `custom_chat_template`), the one place it is written down.

ChatML with a Hermes "# Tools" system section; reasoning in <reason>, the final answer in <answer> with
\\boxed{}; tool calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; tool results rendered
in a *user* turn as <tool_response>...</tool_response>; the generation prompt prefills `<reason>`.
The tool is named `python_code_with_standard_io` as in the public code (the paper says
`execute_python_code_with_standard_io`).

Both directions live here: rendering (prompts, tool calls, tool responses, the serving template) and parsing a
model's turn back into its tool calls (`parse_tool_calls`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHATML_TOKENS = (ENDOFTEXT, IM_START, IM_END)
RSTAR_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<answer>", "</answer>", "<reason>", "</reason>")

TOOL_NAME = "python_code_with_standard_io"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": ("Execute Python code with standard input and capture its standard output. The code runs "
                        "in a fresh interpreter; print what you need to see. On an error the exception text is "
                        "returned."),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python code to execute."},
                "input": {"type": "string", "description": "Text fed to the program's standard input."},
            },
            "required": ["code", "input"],
        },
    },
}
# rollout.agent.tool_state=session: the model is told the truth about its tool (state kept between calls)
SESSION_TOOL_SCHEMA = {"type": "function", "function": {**TOOL_SCHEMA["function"], "description": (
    "Execute Python code with standard input and capture its standard output. Variables, functions and imports "
    "persist between your calls in this conversation; print what you need to see. On an error the exception text "
    "is returned.")}}

SYSTEM_PREAMBLE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process and answer are enclosed within <reason> </reason> and <answer> </answer> "
    "tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>."
)
TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
USER_PREFIX = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
               "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n")
GENERATION_PROMPT = f"{IM_START}assistant\n<reason>"


def system_prompt(tools: list[dict] | None = None, preamble: str = SYSTEM_PREAMBLE) -> str:
    """`preamble` (a chat's own system turn, or rStar2's) followed by the "# Tools" section of `tools` (None: the
    python tool; []: no section), as the chat template renders a system turn with tools."""
    tools = [TOOL_SCHEMA] if tools is None else tools
    text = preamble
    if tools:
        text += "\n\n" + TOOLS_SECTION.format(tools="\n".join(json.dumps(t) for t in tools))
    return text


def render_function_call(name: str, arguments: dict) -> str:
    """One tool call as the model writes it (Hermes style)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def render_tool_call(code: str, stdin: str = "") -> str:
    return render_function_call(TOOL_NAME, {"code": code, "input": stdin})


def render_tool_responses(texts: list[str]) -> str:
    """The user turn that carries one or more tool results, followed by the next generation prompt."""
    body = "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)
    return f"{IM_START}user\n{body}{IM_END}\n{GENERATION_PROMPT}"


def render_prompt(question: str, *, tools: list[dict] | None = None, system: str | None = None) -> str:
    """The full prompt text up to and including the prefilled `<reason>`."""
    sys_text = system if system is not None else system_prompt(tools)
    return (f"{IM_START}system\n{sys_text}{IM_END}\n{IM_START}user\n{USER_PREFIX}{question}{IM_END}\n"
            f"{GENERATION_PROMPT}")


# The tools section and a tool turn (consecutive ones merged into one user turn), shared by both templates
_TOOLS_JINJA = (
    "{%- if tools -%}{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}{%- endif -%}"
)
_TOOL_TURN_JINJA = (
    "{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
)
# The same format as a Hugging Face chat template, so `tokenizer.apply_chat_template` (and vLLM's chat
# API) render exactly what render_prompt / render_tool_responses produce. Tool messages are merged into one
# user turn; `add_generation_prompt` prefills <reason>.
CHAT_TEMPLATE = (
    "{%- set default_system = " + json.dumps(SYSTEM_PREAMBLE) + " -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] -}}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{{- '<|im_start|>system\\n' + default_system -}}{%- set loop_messages = messages -%}{%- endif -%}"
    + _TOOLS_JINJA +
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    + _TOOL_TURN_JINJA +
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<reason>' -}}{%- endif -%}"
)


def serving_chat_template(default_system: str) -> str:
    """The chat template of an exported model (`rstar-hpc export`): CHAT_TEMPLATE plus the defaults that make a
    plain chat render what the rollout fed the model. Without a system message the system turn is
    `default_system` (the run's: the preamble and the python tool's schema), or the preamble with the `tools`
    given; a user turn without the rStar2 instruction (USER_PREFIX) gets it; an assistant turn gets the `<reason>`
    the generation prompt prefilled, and its `tool_calls` (a parser's output) back as <tool_call> text, as
    render_function_call writes them. So `apply_chat_template([{"role": "user", "content": q}], tools=[TOOL_SCHEMA],
    add_generation_prompt=True)` is render_prompt(q), and a served model's replies append without changing it."""
    return (
        "{%- set default_system = " + json.dumps(default_system) + " -%}"
        "{%- set user_prefix = " + json.dumps(USER_PREFIX) + " -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] -}}{%- set loop_messages = messages[1:] -%}"
        "{%- elif tools -%}{{- '<|im_start|>system\\n' + " + json.dumps(SYSTEM_PREAMBLE) + " -}}"
        "{%- set loop_messages = messages -%}"
        "{%- else -%}{{- '<|im_start|>system\\n' + default_system -}}{%- set loop_messages = messages -%}{%- endif -%}"
        + _TOOLS_JINJA +
        "{{- '<|im_end|>\\n' -}}"
        "{%- for message in loop_messages -%}"
        "{%- if message['role'] == 'tool' -%}" + _TOOL_TURN_JINJA +
        "{%- elif message['role'] == 'user' -%}{%- set text = message['content'] -%}"
        "{{- '<|im_start|>user\\n' + ('' if text.startswith(user_prefix) else user_prefix) + text + '<|im_end|>\\n' -}}"
        "{%- elif message['role'] == 'assistant' -%}{%- set ns = namespace(text=message['content'] or '') -%}"
        "{%- for call in message['tool_calls'] or [] -%}"
        "{%- set fn = call['function'] if call['function'] is defined else call -%}"
        "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson -%}"
        "{%- set ns.text = (ns.text + '\\n' if ns.text | trim else '') + '<tool_call>\\n{\"name\": ' + fn['name'] | tojson"
        " + ', \"arguments\": ' + args + '}\\n</tool_call>' -%}"
        "{%- endfor -%}"
        "{{- '<|im_start|>assistant\\n' + ('' if ns.text.startswith('<reason>') else '<reason>') + ns.text"
        " + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<reason>' -}}{%- endif -%}"
    )


# --------------------------------------------------------------------------------------------------- parsing
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedCall:
    raw: str
    name: str = ""
    code: str = ""
    stdin: str = ""
    error: str | None = None
    """Set when the call cannot run; `error_status` says how it is recorded."""
    error_status: str = "parse_error"


def parse_tool_calls(text: str) -> list[ParsedCall] | None:
    """The calls of one assistant turn (rStar2-Agent paper §2.1; microsoft/rStar rstar2_agent/tools/tool_parser.py).
    None: no complete <tool_call> block, the model answered. A call that does not decode comes back with `error`
    set; it is answered as a tool response, not dropped."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return None
    calls = []
    for raw in _TOOL_CALL.findall(text):
        call = ParsedCall(raw=raw.strip())
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            call.error = f"Failed to decode tool call: {e}"
            calls.append(call)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call.error = 'Failed to decode tool call: expected {"name": ..., "arguments": {...}}'
            calls.append(call)
            continue
        call.name = obj["name"]
        args = obj.get("arguments", {})
        if isinstance(args, str):   # some models double-encode the arguments
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                args = None
                call.error = f"Failed to decode tool call arguments: {e}"
        if call.error is None and not isinstance(args, dict):
            call.error = "Failed to decode tool call: arguments must be a JSON object"
        if call.error is None:
            code, stdin = args.get("code"), args.get("input", "")
            if call.name != TOOL_NAME:
                call.error, call.error_status = (f"Error when executing tool: unknown tool {call.name!r}; "
                                                 f"the only tool is {TOOL_NAME!r}"), "invalid_request"
            elif not isinstance(code, str) or not isinstance(stdin, (str, type(None))):
                call.error, call.error_status = ("Error when executing tool: arguments need 'code' (string) and "
                                                 "'input' (string)"), "invalid_request"
            else:
                call.code, call.stdin = code, stdin or ""
        calls.append(call)
    return calls
