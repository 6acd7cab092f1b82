"""The subcommands of `lockstep`, one module of this package each, with their one-line help.

Why it exists: `lockstep COMMAND` imports only COMMAND's module (a module imports what it runs at its
top, so `lockstep run` pulls in torch while `lockstep validate` stays light); the listing of
`lockstep --help` needs only these lines.

Who calls it: lockstep.cli (the parser), each subcommand module (its help line).
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "convert-model": "write a checkpoint's low-precision serving copy (fp8, mxfp8, nvfp4; SGLang layout)",
    "delta": "publish, apply and verify disk-delta weight versions",
    "driver": "run the RL loop of a rendered job (driver pod)",
    "engine": "serve the reference rollout engine (SGLang HTTP API subset)",
    "launch": "torchrun with the rendezvous store bound to this pod's address (trainer rank pods)",
    "metrics-relay": "serve another endpoint's GET /metrics on this port (SGLang engine pods' metrics port)",
    "pull-model": "download a Hugging Face model (org/name[@rev]) into a directory",
    "precision-check": "validate a job's low-precision recipe in the order of §6 (quantizer .. ratio)",
    "run": "run an RLJob manifest on this machine",
    "sessions": "serve the TITO session server (token-exact multi-turn agent sessions)",
    "trainer": "run one trainer rank (torchrun env)",
    "unload-adapter": "unload every version of a LoRA adapter from engines (a deleted job's, on a shared pool)",
    "validate": "check manifests offline (schema and cross-field rules)",
}
"""Subcommand (= module name in lockstep.cli) -> its help line."""
