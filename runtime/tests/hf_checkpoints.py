"""Small checkpoints in real Hugging Face layout, one per model family, built offline in the tests.

Why it exists: the runtime must load what users have (config.json, sharded safetensors with an
index, tokenizer.json, tokenizer_config.json with the family's chat template, generation_config.json),
not only Lockstep's own built-in. Nothing is downloaded: the weights are a random init of the
family's transformers class at a tiny size, the tokenizer a byte-level BPE trained here with the
`tokenizers` library carrying the family's real control tokens, and the chat template is the
family's published one (Qwen3's from its tokenizer_config.json; GLM-5's, which the tests check
byte for byte against SGLang's own Python port of it).

Families: `qwen3` (Qwen3ForCausalLM), `qwen3-moe` (Qwen3MoeForCausalLM), `glm5`
(GlmMoeDsaForCausalLM: MLA attention with the DSA indexer, shared + routed experts).

Who calls it: runtime/tests (the `hf_checkpoint` fixture of runtime/tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN3_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
GLM5_SPECIALS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)

# Qwen3's chat template as published in its tokenizer_config.json (Qwen3 dense and MoE share it).
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# GLM-5's chat template (text models: no multimodal parts, tool results in message order).
GLM5_TEMPLATE = (
    "[gMASK]<sop><|system|>Reasoning Effort: "
    "{{ (reasoning_effort if reasoning_effort in ['low', 'high'] else 'max') | capitalize -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- if tool.function is defined -%}{%- set tool = tool.function -%}{%- endif -%}"
    "{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tools>\\n\\nFor each function call, output the function name and arguments within the following "
    "XML format:\\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
    "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'user' -%}<|user|>{{- content -}}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else none -%}"
    "{%- if reasoning is none and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- if (not clear_thinking or loop.index0 > ns.last_user) and reasoning is not none -%}"
    "{{- '<think>' + reasoning + '</think>' -}}"
    "{%- else -%}<think></think>{%- endif -%}"
    "{%- if content.strip() -%}{{- content.strip() -}}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- if tc.function -%}{%- set tc = tc.function -%}{%- endif -%}"
    "{{- '<tool_call>' + tc.name -}}"
    "{%- for k, v in tc.arguments.items() -%}"
    "<arg_key>{{- k -}}</arg_key><arg_value>{{- v if v is string else v | tojson(ensure_ascii=False) -}}</arg_value>"
    "{%- endfor -%}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "<tool_response>{{- content -}}</tool_response>"
    "{%- elif m.role == 'system' -%}<|system|>{{- content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)

_CORPUS = (
    "You are a helpful assistant. rev 3841 1483 What is 12 * 7? The answer is 84. calc 12+7 = 19 "
    '{"name": "calc", "arguments": {"expression": "12 * 7"}} {"result": 84} Reasoning Effort: Max '
    "Let me think step by step. First multiply, then add. Natalia sold clips to 48 of her friends. "
    "#### 72 system user assistant tool observation think tool_call tool_response arg_key arg_value "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } : , . ? ! \n \n\n  # Tools <tools></tools> "
)

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "specials": QWEN3_SPECIALS,
        "template": QWEN3_TEMPLATE,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ("<|im_end|>", "<|endoftext|>"),
        "family": "qwen3",
    },
    "qwen3-moe": {
        "specials": QWEN3_SPECIALS,
        "template": QWEN3_TEMPLATE,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ("<|im_end|>", "<|endoftext|>"),
        "family": "qwen3",
    },
    "glm5": {
        "specials": GLM5_SPECIALS,
        "template": GLM5_TEMPLATE,
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "stops": ("<|endoftext|>", "<|user|>", "<|observation|>"),
        "family": "glm5",
    },
}
"""Fixture name -> tokenizer facts (control tokens, template, eos/pad, stop tokens) and the Lockstep family."""

VOCAB = 512
"""Vocabulary size of every fixture tokenizer (and of the models' embeddings)."""


def train_tokenizer(specials: tuple[str, ...]) -> Tokenizer:
    """A deterministic byte-level BPE with `specials` as single added tokens (IDs 0..)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 8, trainer)
    return tok


def model_config(name: str, ids: dict[str, int]) -> Any:
    """The tiny transformers config of fixture `name` (its real family class, small sizes)."""
    from transformers import GlmMoeDsaConfig, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": None,
    }
    facts = FAMILIES[name]
    eos = [ids[s] for s in facts["stops"]]
    if name == "qwen3":
        cfg = Qwen3Config(
            **common, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
            eos_token_id=eos[0], pad_token_id=ids[facts["pad"]],
        )  # fmt: skip
    elif name == "qwen3-moe":
        cfg = Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            eos_token_id=eos[0], pad_token_id=ids[facts["pad"]],
        )  # fmt: skip
    else:
        cfg = GlmMoeDsaConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            index_topk=16, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
            eos_token_id=eos, pad_token_id=ids[facts["pad"]],
        )  # fmt: skip
    return cfg


def write_checkpoint(name: str, directory: Path, seed: int = 0, max_shard_size: str = "200KB") -> Path:
    """Write fixture `name` (a key of FAMILIES) into `directory` in HF layout; returns it.

    Weights are sharded (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    facts = FAMILIES[name]
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(facts["specials"])
    ids = {s: int(tok.token_to_id(s)) for s in facts["specials"]}
    cfg = model_config(name, ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "eos_token": facts["eos"],
        "pad_token": facts["pad"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": facts["template"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {"eos_token_id": [ids[s] for s in facts["stops"]], "pad_token_id": ids[facts["pad"]]}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory
