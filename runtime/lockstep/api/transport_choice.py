"""The transport file: the WeightChannel's chosen transport, handed from the operator to the trainer ranks.

Why it exists: with spec.weightSync.transport `auto` the operator's WeightChannel reconcile picks the
transport from the nodes the pods landed on (status.transport plus a one-line reason). That choice
is made after the trainer rank pods exist, so it cannot be an env var of theirs without rolling them.
The RLJob reconcile writes it instead as one JSON document under the key `transport.json` of the
job's config ConfigMap (`<job>-config`), which every rank mounts at /etc/lockstep; the kubelet
refreshes a mounted ConfigMap in running pods, and this key is not part of the pod-template hash.
Rank 0 of `lockstep trainer --serve` reads it to resolve `auto`. Both sides import this module, so it
lives in lockstep.api (pydantic only, no torch).

Who calls it: lockstep_operator.resources.config (writes, `TransportChoice.to_json`),
lockstep.weights.factory (reads, `load_transport_choice`), tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TRANSPORT_KEY = "transport.json"
"""The data key of the job's config ConfigMap holding the document (a file next to job.yaml)."""

DEFAULT_TRANSPORT_FILE = Path("/etc/lockstep") / TRANSPORT_KEY
"""Where a trainer rank pod sees the document (the config ConfigMap's mount)."""

ChosenTransport = Literal["broadcast", "p2p", "disk-delta", "cuda-ipc"]
"""A transport the WeightChannel can choose (never `auto`)."""


class TransportChoice(BaseModel):
    """The WeightChannel's choice, as the operator writes it (camelCase on the wire)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    transport: ChosenTransport
    """The transport the ranks update the engines' weights with (the WeightChannel's status.transport)."""
    reason: str = Field(min_length=1, max_length=1024)
    """Why it was chosen (the WeightChannel's status.reason), logged by the trainer."""
    observed_generation: int | None = Field(default=None, ge=0, alias="observedGeneration")
    """The WeightChannel's status.observedGeneration when the choice was copied; None when unset."""

    def to_json(self) -> str:
        """The document as written into the ConfigMap (stable key order)."""
        return self.model_dump_json(by_alias=True, exclude_none=True)


class TransportFileError(ValueError):
    """The transport file exists but is not a valid TransportChoice; the message names the file."""


def load_transport_choice(path: Path) -> TransportChoice | None:
    """The choice in `path`; None when the file does not exist (yet).

    Raises TransportFileError naming the file and the first bad field when it does not validate.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return TransportChoice.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise TransportFileError(
            f"{path}: {where}: {first['msg']}; the operator writes this file from the WeightChannel "
            "(key transport.json of the job's config ConfigMap): fix or delete it, or set "
            "spec.weightSync.transport explicitly"
        ) from None
