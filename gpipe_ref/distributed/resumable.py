"""A training run that survives a rank's death: checkpoints every few steps, torchrun restarts, the run resumes.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m gpipe_ref.distributed.resumable \\
        --folder ckpt --steps 8 --every 2 --kill-rank 1 --kill-step 5

Every rank trains the FSDP-sharded MLP block of ``checkpointing`` and saves a DCP checkpoint every ``--every`` steps
into ``FOLDER/<steps done>``. On torchrun's first attempt rank ``--kill-rank`` kills itself (SIGKILL, as an
out-of-memory killer or a lost machine would) before step ``--kill-step``; torchrun's agent stops the other ranks
and starts them all again (``--max-restarts``), and each resumes from the newest complete checkpoint. Rank 0
appends one JSON line per step to ``FOLDER/losses.jsonl``: the attempt, the step and its loss.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from .checkpointing import CheckpointSetup, build, latest, load, local_batch, save, train_steps
from .torchrun import init_from_env, restart_count

__all__ = ["run", "run_under_torchrun", "main"]


def run(folder: Path, steps: int, every: int, kill: tuple[int, int] | None, setup: CheckpointSetup) -> None:
    """This rank's part of the run (torchrun started it): resume, train, save every ``every`` steps."""
    rank, world = init_from_env(timeout=60.0)
    try:
        model, optimizer = build("fsdp", world, setup)
        newest = latest(folder)
        done = load(newest, model, optimizer) if newest is not None else 0
        x, y = local_batch("fsdp", rank, world, setup)
        for step in range(done, steps):
            if kill is not None and restart_count() == 0 and (rank, step) == kill:
                os.kill(os.getpid(), signal.SIGKILL)
            (loss,) = train_steps(model, optimizer, x, y, 1, "fsdp")
            if rank == 0:
                with open(folder / "losses.jsonl", "a") as log:
                    log.write(json.dumps({"attempt": restart_count(), "step": step, "loss": loss}) + "\n")
            if (step + 1) % every == 0 or step + 1 == steps:
                save(folder / str(step + 1), model, optimizer, step + 1)
    finally:
        dist.destroy_process_group()


def run_under_torchrun(folder: str | os.PathLike[str], steps: int = 8, every: int = 2,
                       kill: tuple[int, int] | None = (1, 5), ranks: int = 2, restarts: int = 1,
                       timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Start this run with torchrun (``python -m torch.distributed.run``: the agent that starts, watches and
    restarts the ranks) on this machine; its output. Past ``timeout`` seconds the agent and every rank it started
    are killed (they share a new session) and TimeoutError names the run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--max-restarts", str(restarts), "--monitor-interval", "0.5", "-m", "gpipe_ref.distributed.resumable",
               "--folder", os.fspath(folder), "--steps", str(steps), "--every", str(every)]
    if kill is not None:
        command += ["--kill-rank", str(kill[0]), "--kill-step", str(kill[1])]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = agent.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate()
        raise TimeoutError(f"the torchrun run in {os.fspath(folder)!r} did not finish within {timeout} s: its agent "
                           f"and ranks were killed") from None
    return subprocess.CompletedProcess(command, agent.returncode, out, err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpipe_ref.distributed.resumable", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="where the checkpoints and losses.jsonl go")
    parser.add_argument("--steps", type=int, default=8, help="steps of the whole run (default 8)")
    parser.add_argument("--every", type=int, default=2, help="save a checkpoint every this many steps (default 2)")
    parser.add_argument("--kill-rank", type=int, help="the rank that dies on the first attempt (default: none)")
    parser.add_argument("--kill-step", type=int, default=0, help="the step it dies before (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the model and the data (default 0)")
    args = parser.parse_args(argv)
    for name in ("steps", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    args.folder.mkdir(parents=True, exist_ok=True)
    kill = None if args.kill_rank is None else (args.kill_rank, args.kill_step)
    run(args.folder, args.steps, args.every, kill, CheckpointSetup(seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
