"""The chat templates known by name (llama.cpp's built-in formats of those names), for a
``chat_template`` setting that names one instead of giving a template's text."""

from __future__ import annotations

__all__ = ["CHATML_TEMPLATE", "COMMAND_R_TEMPLATE", "GEMMA_TEMPLATE", "KNOWN_TEMPLATES", "LLAMA3_TEMPLATE",
           "resolve_template"]

# ChatML as llama.cpp's built-in "chatml" template writes it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '')"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma 3 instruction-tuned format: BOS, an optional system message folded into
# the first user turn, roles user/model alternating, turns closed by
# <end_of_turn>, message text trimmed (as Google's published template does).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# llama.cpp's built-in "llama3" format (src/llama-chat.cpp, LLM_CHAT_TEMPLATE_LLAMA_3): every message
# as a header with its role and its trimmed text closed by <|eot_id|>; BOS comes from the tokenizer.
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + ((message['content'] if message['content'] is string else '') | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# llama.cpp's built-in "command-r" format (LLM_CHAT_TEMPLATE_COMMAND_R, CohereForAI/c4ai-command-r-plus):
# system / user / assistant turns with their role tokens and trimmed text; other roles are not written.
COMMAND_R_TEMPLATE = (
    "{%- set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} %}"
    "{%- for message in messages %}{%- if message['role'] in tokens %}"
    "{{- '<|START_OF_TURN_TOKEN|>' + tokens[message['role']]"
    " + ((message['content'] if message['content'] is string else '') | trim) + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"
)

KNOWN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "command-r": COMMAND_R_TEMPLATE,
}


def resolve_template(name_or_text: str) -> str:
    """A known template name (``"chatml"``, ``"gemma"``, ``"gemma3"``, ``"llama3"``, ``"command-r"``: llama.cpp's
    built-in formats of those names) -> its text; any other string is a template text."""
    return KNOWN_TEMPLATES.get(name_or_text.strip().lower(), name_or_text)
