"""Checkpoints with a chat template that takes tools: Qwen3.5's XML tool-call form on a tiny model."""

import json
import shutil

XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- set c = c.function %}<tool_call>\n<function={{ c.name }}>\n"
    "{%- for k, v in c.arguments | items %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
XML_TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object",
    "properties": {"kind": {"type": "string", "enum": ["red", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tag": {"type": "string", "maxLength": 3}},
    "required": ["kind", "n"]}}}]


def with_template(folder, template, into):
    """A copy of the checkpoint in `folder` whose chat template is `template`."""
    shutil.copytree(folder, into)
    config = json.loads((into / "tokenizer_config.json").read_text())
    (into / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    return into
