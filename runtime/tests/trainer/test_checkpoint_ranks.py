"""save_checkpoint with 2 real FSDP ranks (gloo on CPU): rank 0 alone creates, renames and removes.

Every rank calls save_checkpoint (a TrainBackend's methods are collective). A re-save of the step
`latest` names points `latest` at the temporary copy for a moment; rank 1, already done with its
part, starts the next save right then. It used to look up its temporary directory from `latest`
(`.tmp` or `.tmp2`) and so could write its files where rank 0 did not, and every rank removed the
temporary directory. The interleaving is forced, not timed: rank 0 stops after that pointer write
until rank 1 is inside `backend.save` of the next save.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from lockstep.models import resolve_checkpoint
from lockstep.trainer.state import latest_checkpoint

RANK = """
import json, os, shutil, sys, time
from pathlib import Path
import lockstep.trainer.state as st
from lockstep.train.fsdp import FSDPBackend, FSDPConfig

model_dir, run_dir, box = (Path(a) for a in sys.argv[1:4])
rank = int(os.environ["RANK"])
backend = FSDPBackend(FSDPConfig(model_path=model_dir, device="cpu"))
state = st.DriverState(step=1)


def wait_for(flag: Path) -> None:
    deadline = time.monotonic() + 120  # a hang guard
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(flag)
        time.sleep(0.02)


touched = []  # removals and renames by this rank outside backend.save (its own files are its own)
inside = [False]
if rank == 0:
    write = st.atomic_write_text
    def pausing(path, text):
        write(path, text)
        if text.strip() == ".step_000001.tmp":  # the re-save points `latest` at its temporary copy
            wait_for(box / "rank1-in-next-save")
    st.atomic_write_text = pausing
else:
    for mod, name in ((st.shutil, "rmtree"), (st.os, "replace")):
        real = getattr(mod, name)
        def recording(*args, real=real, name=name, **kwargs):
            if not inside[0]:
                touched.append([name, *map(str, args)])
            return real(*args, **kwargs)
        setattr(mod, name, recording)
    save = backend.save
    calls = [0]
    def announcing(directory, extra=None):
        calls[0] += 1
        if calls[0] == 3:
            (box / "rank1-in-next-save").touch()
        inside[0] = True
        try:
            save(directory, extra)
        finally:
            inside[0] = False
    backend.save = announcing

st.save_checkpoint(backend, run_dir, state)  # the first save of step 1
st.save_checkpoint(backend, run_dir, state)  # a re-save of the step `latest` names
st.save_checkpoint(backend, run_dir, state)  # rank 1 starts it while rank 0 finishes the re-save
(box / f"touched{rank}.json").write_text(json.dumps(touched))
backend.close()
from lockstep.cli.trainer import end_worker
end_worker(0, {"TORCHELASTIC_RUN_ID": "test"})  # as a rank ends: no C++ teardown (it can abort, SIGABRT)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(resolve_checkpoint("builtin:tiny", cache_dir=tmp_path_factory.mktemp("cache")))


def _run_two_ranks(script: Path, args: list[Path], tmp_path: Path) -> None:
    """Run `script` as ranks 0 and 1 of a gloo world on loopback; both must exit 0 (logs in tmp_path)."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    base.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    logs = [(tmp_path / f"rank{r}.log").open("w") for r in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]  # a hang guard
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    assert codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))


def test_two_ranks_save_one_complete_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    run_dir, box = tmp_path / "run", tmp_path / "box"
    box.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    _run_two_ranks(script, [model_dir, run_dir, box], tmp_path)
    found = latest_checkpoint(run_dir)
    assert found is not None and found.name == "step_000001"
    files = sorted(p.name for p in found.iterdir())
    for name in (
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "trainer_state.json",
        "rng_rank0.pt",
        "rng_rank1.pt",
    ):
        assert name in files, files
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (box / "touched1.json").read_text() == "[]"  # rank 1 removed and renamed nothing


REFERENCE_RANK = """
import json, os, sys
from pathlib import Path
from lockstep.train.common.losses import sft_loss
from lockstep.train.common.packing import pack_sft
from lockstep.train.fsdp import FSDPBackend, FSDPConfig
from lockstep.trainer.spmd import LeaderBackend, control_group, follow
from lockstep.trainer.state import save_reference

model_dir, run_dir, out = (Path(a) for a in sys.argv[1:4])
backend = FSDPBackend(FSDPConfig(model_path=model_dir, device="cpu", lr=1e-2, with_ref=True))
group = control_group()
if int(os.environ["RANK"]) == 0:
    lead = LeaderBackend(backend, group)
    batch = pack_sft([([2, 10, 11, 3], [12, 13, 1]), ([2, 14, 3], [15, 16, 1])])
    loaded = lead.compute_logprobs(batch, role="ref")
    lead.train_step(batch, sft_loss)  # what a warm start does: the policy moves away from the loaded one
    actor = lead.compute_logprobs(batch)
    lead.set_reference(save_reference(lead, run_dir))
    ref = lead.compute_logprobs(batch, role="ref")
    gaps = {"moved": float((actor - loaded).abs().max()), "ref_gap": float((ref - actor).abs().max())}
    out.write_text(json.dumps(gaps))
    lead.release_followers()
else:
    follow(backend, group)
backend.close()
from lockstep.cli.trainer import end_worker
end_worker(0, {"TORCHELASTIC_RUN_ID": "test"})  # as a rank ends: no C++ teardown (it can abort, SIGABRT)
"""


def test_two_ranks_take_the_warm_started_policy_as_kl_reference(model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 serves (LeaderBackend), rank 1 follows: save_reference writes RUN_DIR/reference on both
    ranks' collective save and the mirrored set_reference loads it on both, so the reference's logprobs
    are the trained policy's, not the loaded checkpoint's."""
    run_dir, out, script = tmp_path / "run", tmp_path / "gaps.json", tmp_path / "rank.py"
    run_dir.mkdir()
    script.write_text(REFERENCE_RANK)
    _run_two_ranks(script, [model_dir, run_dir, out], tmp_path)
    gaps = json.loads(out.read_text())
    assert gaps["moved"] > 1e-3  # the step changed the policy, so a stale reference would show
    assert gaps["ref_gap"] < 1e-6, gaps
    assert (run_dir / "reference" / "model.safetensors").is_file()
    assert not (run_dir / ".reference.tmp").exists()
