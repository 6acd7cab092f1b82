"""Pydantic models of the SGLang HTTP payloads the runtime sends and reads.

Why it exists: the runtime talks to real SGLang servers and to our reference engine through one
client; both must accept exactly these bodies. Field names, defaults and shapes are taken from
SGLang's source (python/sglang/srt/managers/io_struct.py: GenerateReqInput, AbortReq,
PauseGenerationReqInput, UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
DestroyWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
UpdateWeightsFromTensorReqInput, UpdateWeightVersionReqInput; sampling_params.py: SamplingParams;
entrypoints/http_server.py for routes and replies). We model only the fields we use: requests are
`extra="forbid"` (what we send is exactly this); replies are parsed with `extra="ignore"` since SGLang
returns more than we read.

Per-token weight versions: SGLang reports them itself, as `meta_info.weight_versions`, spans
{version, start, end} over the output tokens (a span per version that sampled some of them, e.g. when
a retracted request resumed on new weights); the reference engine answers the same. A server that
sends no spans gets the client's honest derivation instead (see client.GenerateResult).

Routes (ROUTES below): POST /generate, POST /abort_request, GET /health, GET /health_generate,
GET|POST /flush_cache, POST /pause_generation, POST /continue_generation,
POST /update_weights_from_disk, POST /init_weights_update_group, POST /destroy_weights_update_group,
POST /update_weights_from_distributed, POST /update_weights_from_tensor, POST /update_weight_version,
POST /weights_checker (CheckWeightsReqInput: the pre-flight), GET /v1/models (the context length, as
max_model_len), GET /model_info (carries weight_version;
the older GET /get_weight_version is gone from the pinned SGLang, so the client never calls it),
POST /load_lora_adapter, /load_lora_adapter_from_tensors and /unload_lora_adapter (LoRA adapters on the
served base; docs/lora.md),
POST /v1/detokenize (the teacher-student tokenizer check of on-policy distillation), GET /v1/models
(the served base and, with --enable-lora, every loaded adapter: which adapter versions an engine holds).
runtime/tests/sglang/ checks every route and body here against the pinned SGLang's own source.

Who calls it: lockstep.serving.client (builds requests, parses replies) and lockstep.engine (parses
requests, builds replies).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"),
    "abort_request": ("POST", "/abort_request"),
    "health": ("GET", "/health"),
    "health_generate": ("GET", "/health_generate"),
    "flush_cache": ("POST", "/flush_cache"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "init_weights_update_group": ("POST", "/init_weights_update_group"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor"),
    "update_weight_version": ("POST", "/update_weight_version"),
    "weights_checker": ("POST", "/weights_checker"),
    "model_info": ("GET", "/model_info"),
    "models": ("GET", "/v1/models"),
    "detokenize": ("POST", "/v1/detokenize"),
    "load_lora_adapter": ("POST", "/load_lora_adapter"),
    "load_lora_adapter_from_tensors": ("POST", "/load_lora_adapter_from_tensors"),
    "unload_lora_adapter": ("POST", "/unload_lora_adapter"),
}
"""Endpoint name -> (HTTP method, path), as served by SGLang's http_server.py."""


class SamplingParams(_Request):
    """The subset of SGLang's SamplingParams the runtime sets (sampling_params.py)."""

    max_new_tokens: int = Field(default=128, ge=0)
    """Budget of tokens to sample after the prompt; 0 only scores the prompt."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Drop tokens below min_p * max prob (SGLang field; our engine supports only 0)."""
    stop_token_ids: list[int] | None = None
    """Extra token IDs that end the sample (the stop token is kept in output_ids)."""
    stop: str | list[str] | None = None
    """Stop strings (SGLang field; our engine does not support them, use stop_token_ids)."""
    ignore_eos: bool = False
    """Keep sampling past the model's eos token."""
    skip_special_tokens: bool = True
    """Drop special tokens from the returned text (IDs are unaffected)."""
    no_stop_trim: bool = False
    """Keep the stop string in the returned text."""
    sampling_seed: int | None = None
    """Per-request seed for reproducible sampling (SGLang's deterministic-inference field)."""


class GenerateRequest(_Request):
    """POST /generate body (GenerateReqInput), token-in: we always send input_ids."""

    input_ids: list[int] | list[list[int]]
    """Prompt token IDs, one list (single request) or a list of lists (batch)."""
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    """One set for all, or one per prompt of a batch."""
    return_logprob: bool = False
    """Return meta_info.output_token_logprobs."""
    logprob_start_len: int = -1
    """With return_logprob, also return input_token_logprobs from this prompt position; -1: none."""
    top_logprobs_num: int = Field(default=0, ge=0)
    """With return_logprob, the most likely tokens per position (meta_info.input_top_logprobs for prompt
    positions from logprob_start_len; the reference engine serves them for scoring requests only)."""
    token_ids_logprob: list[int] | None = None
    """With return_logprob, the token IDs whose logprobs to return at every position
    (meta_info.input_token_ids_logprobs for prompt positions; scoring requests only on our engine)."""
    return_text_in_logprobs: bool = False
    """Fill the third element of each logprob triple with the token text."""
    return_routed_experts: bool = False
    """R3: return the routed expert IDs per token and MoE layer (base64 int32)."""
    rid: str | list[str] | None = None
    """Request ID(s), for /abort_request; generated by the server when absent."""
    stream: bool = False
    """Streaming replies (the runtime never streams)."""
    lora_path: str | None = None
    """The name of the loaded LoRA adapter to sample with (SGLang resolves it by name; the engine must
    run with --enable-lora); None samples the base model."""
    routed_dp_rank: int | None = Field(default=None, ge=0)
    """The data-parallel rank (DP attention worker) that must serve this request; None lets the
    engine's scheduler choose. Set by the TITO session server so every turn of a session reaches the
    rank whose prefix cache holds it (SGLang field; our engine has one rank, 0)."""


class FinishReason(_Reply):
    """meta_info.finish_reason: FINISH_MATCHED_TOKEN -> {type: stop, matched: id}, FINISH_LENGTH ->
    {type: length, length: n}, FINISH_ABORT -> {type: abort, message}."""

    type: Literal["stop", "length", "abort"]
    """Why sampling ended."""
    matched: int | str | None = None
    """The stop token ID (or stop string) that matched."""
    length: int | None = None
    """The max_new_tokens budget that was hit."""
    message: str | None = None
    """Abort reason."""


class WeightVersionSpan(_Reply):
    """One run of output tokens sampled by one weight version: tokens [start, end)."""

    version: str
    """The weight version (a string in SGLang)."""
    start: int = Field(ge=0)
    """First output token index of the run."""
    end: int = Field(ge=0)
    """One past the last output token index of the run."""


class MetaInfo(_Reply):
    """meta_info of a /generate reply (the fields the runtime reads)."""

    id: str = ""
    """The request ID."""
    finish_reason: FinishReason | None = None
    """Why the sample ended (None while streaming)."""
    prompt_tokens: int = 0
    """Prompt length in tokens."""
    completion_tokens: int = 0
    """Number of output tokens."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    weight_version: str | None = None
    """The engine's weight version when the reply was made (a string in SGLang)."""
    output_token_logprobs: list[list[Any]] | None = None
    """Per output token [logprob, token_id, text-or-null]."""
    input_token_logprobs: list[list[Any]] | None = None
    """Per prompt token from logprob_start_len [logprob-or-null, token_id, text-or-null]; the first
    entry's logprob is null whatever logprob_start_len is (nothing of the request predicts it)."""
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    """With top_logprobs_num: per prompt token from logprob_start_len, null or the most likely
    [logprob, token_id, text-or-null] at the position that predicts it (first entry null)."""
    input_token_ids_logprobs: list[list[list[Any]] | None] | None = None
    """With token_ids_logprob: per prompt token from logprob_start_len, null or
    [logprob, token_id, text-or-null] for each asked ID (first entry null)."""
    routed_experts: str | None = None
    """R3 data: base64 of int32 [tokens-1, layers, topk]."""
    weight_versions: list[WeightVersionSpan] | None = None
    """Which weight version sampled which output tokens, as spans (None from servers without them)."""


class GenerateReply(_Reply):
    """One /generate reply (a batch request gets a list of these)."""

    text: str = ""
    """Decoded output text."""
    output_ids: list[int] = Field(default_factory=list)
    """Output token IDs (the stop token included when one matched)."""
    meta_info: MetaInfo
    """Logprobs, counts, finish reason and versions."""


class DetokenizeRequest(_Request):
    """POST /v1/detokenize body (SGLang's OpenAI-protocol DetokenizeRequest)."""

    tokens: list[int] | list[list[int]]
    """One ID list (one text back) or several (one text per list)."""
    skip_special_tokens: bool = True
    """Drop special tokens from the text; the tokenizer check sends false, so every ID decodes."""


class DetokenizeReply(_Reply):
    """/v1/detokenize reply (DetokenizeResponse)."""

    text: str | list[str]
    """The decoded text, or one per ID list."""


class AbortRequest(_Request):
    """POST /abort_request body (AbortReq)."""

    rid: str = ""
    """The request to abort ("" with abort_all)."""
    abort_all: bool = False
    """Abort every request."""


class PauseGenerationRequest(_Request):
    """POST /pause_generation body (PauseGenerationReqInput)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"
    """abort: end running requests; retract: hold them, KV recomputed after continue; in_place: keep KV."""


class ContinueGenerationRequest(_Request):
    """POST /continue_generation body (ContinueGenerationReqInput)."""

    torch_empty_cache: bool = True
    """Return cached CUDA blocks to the driver before resuming."""


class UpdateWeightsFromDiskRequest(_Request):
    """POST /update_weights_from_disk body (UpdateWeightFromDiskReqInput)."""

    model_path: str
    """HF-layout checkpoint dir with the new weights."""
    load_format: str | None = None
    """Loader format (None: auto)."""
    abort_all_requests: bool = False
    """Abort running requests before loading."""
    weight_version: str | None = None
    """The version the engine reports after the update."""
    flush_cache: bool = True
    """Flush the prefix cache after loading."""


class InitWeightsUpdateGroupRequest(_Request):
    """POST /init_weights_update_group body (InitWeightsUpdateGroupReqInput)."""

    master_address: str
    """Rendezvous host (the trainer's rank 0 that broadcasts)."""
    master_port: int
    """Rendezvous port."""
    rank_offset: int
    """This engine's first rank in the group (the trainer source is rank 0)."""
    world_size: int
    """1 (the source) + all engine ranks."""
    group_name: str = "weight_update_group"
    """Name of the group (prefix of the rendezvous keys)."""
    backend: str = "nccl"
    """nccl on GPUs, gloo on CPU."""


class DestroyWeightsUpdateGroupRequest(_Request):
    """POST /destroy_weights_update_group body (DestroyWeightsUpdateGroupReqInput)."""

    group_name: str = "weight_update_group"
    """The group to tear down."""


class UpdateWeightsFromDistributedRequest(_Request):
    """POST /update_weights_from_distributed body (UpdateWeightsFromDistributedReqInput).

    The engine receives one broadcast from rank 0 per name, in order, with these dtypes and shapes.
    """

    names: list[str]
    """HF parameter names, in broadcast order."""
    dtypes: list[str]
    """torch dtype names without the prefix, e.g. "bfloat16"."""
    shapes: list[list[int]]
    """Shape of each tensor."""
    group_name: str = "weight_update_group"
    """The group the broadcasts travel on."""
    flush_cache: bool = True
    """Flush the prefix cache after loading."""
    abort_all_requests: bool = False
    """Abort running requests before loading."""
    weight_version: str | None = None
    """The version the engine reports after the update."""
    load_format: str | None = None
    """Loader format (None: plain named tensors)."""


class UpdateWeightsFromTensorRequest(_Request):
    """POST /update_weights_from_tensor body (UpdateWeightsFromTensorReqInput).

    serialized_named_tensors holds, per TP rank, base64 of SGLang's MultiprocessingSerializer output
    (a ForkingPickler pickle of [(name, tensor), ...]). Unpickling is code execution: our engine
    accepts it only when started with --allow-tensor-updates and then only torch's tensor rebuild
    functions.
    """

    serialized_named_tensors: list[str]
    """Base64 strings, one per TP rank."""
    load_format: str | None = None
    """None (named tensors) or "flattened_bucket" (not supported by our engine)."""
    flush_cache: bool = True
    """Flush the prefix cache after loading."""
    abort_all_requests: bool = False
    """Abort running requests before loading."""
    weight_version: str | None = None
    """The version the engine reports after the update."""


class UpdateWeightVersionRequest(_Request):
    """POST /update_weight_version body (UpdateWeightVersionReqInput)."""

    new_version: str
    """The version to report from now on."""
    abort_all_requests: bool = True
    """Abort running requests first (SGLang's default)."""


CheckAction = Literal["snapshot", "reset_tensors", "compare", "checksum"]
"""What /weights_checker does: `snapshot` copies the engine's weights aside, `reset_tensors` fills every
weight with noise, `compare` checks the weights against the snapshot (HTTP 400 naming each differing
tensor), `checksum` hashes every weight."""


class CheckWeightsRequest(_Request):
    """POST /weights_checker body (CheckWeightsReqInput)."""

    action: CheckAction = "checksum"
    """snapshot | reset_tensors | compare | checksum."""
    allow_quant_error: bool = False
    """compare: accept differences within one quantization step (FP8 engines)."""
    skip_tensor_list: list[str] | None = None
    """Substrings of tensor names left out of reset, compare and checksum."""
    selector: Literal["target", "draft", "all"] = "all"
    """Which model runners: the target model, the speculative draft model, or both."""


class RankChecksums(_Reply):
    """One model runner's answer to `checksum` (SGLang's ChecksumInfo)."""

    checksums: dict[str, str]
    """Engine tensor name -> 16 hex digits (SGLang's tensor_hash)."""
    per_gpu_checksum: str = ""
    """sha256 over the sorted (name, checksum) pairs of this rank."""
    parallelism_info: dict[str, Any] = Field(default_factory=dict)
    """role, tp/dp/pp rank and size of the runner."""


class CheckWeightsReply(_Reply):
    """/weights_checker reply: {success, message} plus, for `checksum`, the ranks and their digest."""

    success: bool
    """Whether the action succeeded (compare: every tensor equal)."""
    message: str = ""
    """Details; for a failed compare, one line per differing tensor (`name=... max_abs_err=...`)."""
    ranks: list[RankChecksums] | None = None
    """checksum: one entry per TP rank and runner."""
    per_engine_checksum: str | None = None
    """checksum: sha256 over the ranks' per_gpu_checksum (equal on engines holding equal weights)."""


class SuccessReply(_Reply):
    """{success, message} reply of the weight endpoints (HTTP 200 on success, 400 on failure)."""

    success: bool
    """Whether the operation succeeded."""
    message: str = ""
    """Details or the error."""
    num_paused_requests: int = 0
    """Requests paused during a disk update (update_weights_from_disk only)."""


class ModelInfoReply(_Reply):
    """GET /model_info reply (the fields the runtime reads)."""

    model_path: str = ""
    """The model path the server loaded."""
    is_generation: bool = True
    """A generative model."""
    weight_version: str | None = None
    """The current weight version."""
    model_type: str | None = None
    """HF model_type, e.g. "qwen3"."""
    architectures: list[str] | None = None
    """HF architectures, e.g. ["Qwen3ForCausalLM"]."""


class ModelCardReply(_Reply):
    """One card of GET /v1/models (SGLang's ModelCard): the base, or a loaded LoRA adapter."""

    id: str
    """The served model name, or the adapter's lora_name."""
    root: str | None = None
    """The model path, or the adapter's lora_path."""
    parent: str | None = None
    """None for the base; for an adapter, the base it is served on."""
    max_model_len: int | None = None
    """The base's context length (None on adapters)."""


class ModelListReply(_Reply):
    """GET /v1/models reply (SGLang's ModelList)."""

    object: str = "list"
    data: list[ModelCardReply] = Field(default_factory=list)

    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters (the cards with a parent)."""
        return [c.id for c in self.data if c.parent is not None]


class LoadLoraAdapterRequest(_Request):
    """POST /load_lora_adapter body (LoadLoRAAdapterReqInput): an adapter directory in peft's layout."""

    lora_name: str
    """The name requests will use (`lora_path` of /generate); refused if already loaded."""
    lora_path: str
    """Directory with adapter_config.json and adapter_model.safetensors, as the engine sees it."""
    pinned: bool = False
    """Keep it in GPU memory (SGLang's LRU never evicts it)."""


class LoadLoraAdapterFromTensorsRequest(_Request):
    """POST /load_lora_adapter_from_tensors body (LoadLoRAAdapterFromTensorsReqInput).

    serialized_named_tensors holds, per TP rank, base64 of a pickled {peft name: tensor} dict (CPU
    tensors by value cross hosts; CUDA tensors travel as IPC handles). expected_checksums: sha256 of
    each tensor's bytes, checked by the engine before it loads (SGLang's adapter-sync check).
    """

    lora_name: str
    """The name requests will use; refused if already loaded."""
    config_dict: dict[str, Any]
    """The adapter's peft adapter_config.json (r, lora_alpha, target_modules, ...)."""
    serialized_named_tensors: list[str]
    """Base64 payloads, one per TP rank."""
    pinned: bool = False
    """Keep it in GPU memory."""
    load_format: str | None = None
    """None (named tensors) or "flattened_bucket" (not sent by the runtime)."""
    expected_checksums: dict[str, str] | None = None
    """Tensor name -> sha256 hex of its bytes; a mismatch, missing or extra tensor fails the load."""


class UnloadLoraAdapterRequest(_Request):
    """POST /unload_lora_adapter body (UnloadLoRAAdapterReqInput); SGLang waits for the requests that
    use the adapter to finish, then frees it."""

    lora_name: str
    """The adapter to unload."""


class LoraUpdateReply(_Reply):
    """Reply of the three adapter routes (LoRAUpdateOutput; HTTP 200 on success, 400 on failure)."""

    success: bool
    """Whether the load or unload happened."""
    error_message: str | None = None
    """Why not."""
    loaded_adapters: dict[str, Any] | None = None
    """name -> path (or SGLang's LoRARef) of every adapter loaded afterwards."""
