"""Training checkpoints for resume, and a clean stop on SIGTERM.

A training job can die at any step: a rank killed (kill -9, out of memory, a lost node), or the job ended by Slurm
at its time limit or by preemption (SIGTERM first, with ``--signal``, then SIGKILL). What it learned up to its last
checkpoint is kept, and its rerun goes on from there:

- every ``train.checkpoint_every_n_steps`` optimizer steps, and when a SIGTERM has reached any rank, rank 0 writes
  a full Lightning checkpoint (model, optimizer, schedule, loop state and every rank's random state) atomically
  into the model's resume folder, ``results/models/.{name}.resume/`` beside the model file: outside the job's
  declared outputs, which Snakemake deletes when a job fails;
- the ranks agree on stopping at each step's end (a one-number all-reduce of "did a SIGTERM reach you"), so a
  signal that reached one rank stops all of them at the same step and none is left waiting in a collective; the
  job then exits with :data:`STOP_EXIT_CODE` and says where its checkpoint is (dataloader workers ignore
  SIGTERM: their rank ends them);
- beside each checkpoint, the training curves up to it (``step-N.metrics.csv``), so that the metrics CSV of a
  resumed run still starts at step 0;
- on start, a resume checkpoint whose fingerprint (the task, model, tiling and train config, the scenes and the
  world size) matches the run's is resumed from (``trainer.fit(ckpt_path=...)``); otherwise the run says in one
  line why it starts at step 0. The folder is removed once the model is written.

A resumed run goes on exactly as the uninterrupted run would, also within an epoch: every rank's random state is
saved and restored, and so is how many batches of its epoch the run took; the training samples of that epoch go
on from there, flipped as before (:mod:`rasterscale.datasets.sampling`; left to Lightning, a resumed epoch started its
data over, with fresh random flips).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import random
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function

from rasterscale.atomic import atomic_path, write_json
from rasterscale.runtime.lifetime import SIGTERM_EXIT_CODE, bind_worker, exit_at_once
from rasterscale.runtime.ranks import gather_to_all
from rasterscale.settings import Settings, to_dict

STOP_EXIT_CODE = SIGTERM_EXIT_CODE  # 143, what a shell reports for a process ended by SIGTERM
RESUME_FILE = "resume.json"  # the resume folder's index: fingerprint, step, checkpoint file
# train keys that change nothing a checkpoint holds: a run may resume with other values
UNFINGERPRINTED_TRAIN_KEYS = ("log_every_n_steps", "checkpoint_every_n_steps")


class StoppedBySignal(Exception):
    """Every rank stopped training together after a SIGTERM, once the checkpoint was written."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"stopped by SIGTERM at step {step}; checkpoint {checkpoint}; rerun to resume")


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: a checkpoint and its step, or none (``why`` says why, for the log)."""

    checkpoint: Path | None
    step: int
    why: str

    def earlier_metrics(self) -> list[dict[str, str]]:
        """The training curves up to the checkpoint (none without one)."""
        return read_metrics(metrics_of(self.checkpoint)) if self.checkpoint is not None else []


def metrics_of(checkpoint: Path) -> Path:
    """The training curves saved with a resume checkpoint: ``step-N.metrics.csv`` beside ``step-N.ckpt``."""
    return checkpoint.with_suffix(".metrics.csv")


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    """The rows of a metrics CSV (none when it does not exist)."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def write_metrics(rows: Sequence[Mapping[str, str]], path: str | Path) -> None:
    """Rows as a CSV (atomically), with every column any row has, in the order they first appear."""
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["step", "epoch"]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def training_resume_dir(model_path: str | Path) -> Path:
    """The resume folder of a model file: ``results/models/.{name}.resume/`` for ``results/models/{name}.pt``."""
    model = Path(model_path)
    return model.with_name(f".{model.stem}.resume")


def training_fingerprint(settings: Settings, scenes: Sequence[Any], world_size: int) -> str:
    """What a checkpoint must have been trained with to be resumed from: the task, model, tiling and train settings
    (but the keys of :data:`UNFINGERPRINTED_TRAIN_KEYS`), the training scenes and the world size (their JSON
    values, hashed)."""
    train = {key: value for key, value in to_dict(settings.train).items() if key not in UNFINGERPRINTED_TRAIN_KEYS}
    what = {
        "task": settings.task,
        "model": to_dict(settings.model),
        "tiling": to_dict(settings.tiling),
        "train": train,
        "scenes": [asdict(scene) for scene in scenes],
        "world_size": world_size,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_resume_point(folder: str | Path, expected: str) -> ResumePoint:
    """The checkpoint of ``folder`` to resume from, when its fingerprint is ``expected``."""
    index = Path(folder) / RESUME_FILE
    if not index.exists():
        return ResumePoint(None, 0, f"no resume checkpoint in {folder}: training from step 0")
    try:
        entry = json.loads(index.read_text())
        checkpoint, step, found = Path(folder) / entry["checkpoint"], int(entry["step"]), entry["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return ResumePoint(None, 0, f"{index} is unreadable ({err}): starting over at step 0")
    if found != expected:
        return ResumePoint(
            None,
            0,
            f"resume checkpoint {checkpoint} was written by another run (its task, model, tiling or train config, "
            "scenes or world size differ): starting over at step 0",
        )
    if not checkpoint.exists():
        return ResumePoint(None, 0, f"resume checkpoint {checkpoint} is missing: starting over at step 0")
    return ResumePoint(checkpoint, step, f"resuming from {checkpoint} at step {step}")


def remove_training_resume_dir(folder: str | Path) -> None:
    """Drop the resume checkpoints once the model is written (rank 0)."""
    shutil.rmtree(folder, ignore_errors=True)


def stop_agreed(trainer: L.Trainer, stop: bool) -> bool:
    """Whether any rank wants to stop (a one-number all-reduce: every rank must call it at the same point)."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        flag = torch.tensor([int(stop)], device=trainer.strategy.root_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
    return stop


def random_state() -> dict[str, Any]:
    """This process's random generators (torch, CUDA, numpy, Python), as tensors and plain values."""
    # numpy's stub gives a call without arguments the dict of legacy=False; the default (legacy=True) returns this
    legacy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy_state
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`random_state` saved."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(tuple(item if not isinstance(item, list) else tuple(item) for item in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def exit_stopped() -> None:
    """End a stopped rank with :data:`STOP_EXIT_CODE` at once (:func:`~rasterscale.runtime.lifetime.exit_at_once`): the
    interpreter's teardown would take seconds of those Slurm leaves before SIGKILL."""
    exit_at_once(STOP_EXIT_CODE)


def init_training_worker(worker_id: int, rank: int, rank_pid: int) -> None:
    """A training dataloader worker dies with its rank (``rank_pid``: :func:`lifetime.bind_worker`) and ignores
    SIGTERM (Slurm signals every process of a job step): its rank stops it once the checkpoint is written. Then
    Lightning's seeding of workers, as Lightning would have done."""
    bind_worker(worker_id, rank_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pl_worker_init_function(worker_id, rank)


class ResumeCheckpoints(L.Callback):
    """Periodic resume checkpoints, and the stop of every rank at the same step when a SIGTERM reached one.

    At each step's end every rank takes part in one all-reduce (the stop flag) and, when a checkpoint is due, in
    Lightning's checkpoint (only rank 0 writes it). A stop raises :class:`StoppedBySignal` on every rank.
    """

    def __init__(
        self,
        folder: str | Path,
        run_fingerprint: str,
        every_n_steps: int,
        logger: logging.Logger,
        metrics: tuple[list[dict[str, str]], Path] = ([], Path("metrics.csv")),
        resume_data_at: Callable[[int, int], None] | None = None,
    ) -> None:
        """``metrics``: the curves of the runs before this one (those saved with the resumed checkpoint) and the
        CSV this run's logger writes. ``resume_data_at(epoch, batches)``: told, when a checkpoint is resumed, how
        many batches of its epoch the interrupted run took (the training samples go on from there)."""
        self.folder, self.fingerprint, self.every, self.logger = Path(folder), run_fingerprint, every_n_steps, logger
        self.earlier_metrics, self.logged_metrics = metrics
        self.resume_data_at = resume_data_at
        self.signalled = False
        self._trainer: L.Trainer | None = None

    # --- the signal ----------------------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.signalled:
            self.logger.warning("received SIGTERM: stopping after this step, once its checkpoint is written")
        self.signalled = True

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # Lightning's own SIGTERM handler broadcasts from inside the handler (ranks hang) and stops only the ranks
        # it reached; this one only raises a flag that the ranks agree on at the step's end. Lightning restores
        # the previous handler when fit ends.
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stop = stop_agreed(trainer, self.signalled)
        step = trainer.global_step
        last = 0 < trainer.max_steps <= step
        due = self.every > 0 and step % self.every == 0 and not last
        if not (stop or due):
            return
        path = self.save(trainer)
        if stop:
            raise StoppedBySignal(step, path)

    # --- the checkpoint ------------------------------------------------------------------------------------
    def save(self, trainer: L.Trainer) -> Path:
        """Every rank's part of a resume checkpoint at the current step; rank 0 writes it atomically, then the
        folder's index, then drops the older checkpoints."""
        step = trainer.global_step
        path = self.folder / f"step-{step:07d}.ckpt"
        if not trainer.is_global_zero:
            trainer.save_checkpoint(path)  # collective; only rank 0 writes
            return path
        with atomic_path(path) as tmp:
            trainer.save_checkpoint(tmp)
        if trainer.logger is not None:
            trainer.logger.save()
        write_metrics(self.metrics(trainer), metrics_of(path))
        write_json({"fingerprint": self.fingerprint, "step": step, "checkpoint": path.name}, self.folder / RESUME_FILE)
        for old in self.folder.glob("step-*"):
            if old not in (path, metrics_of(path)):
                old.unlink(missing_ok=True)
        self.logger.info("checkpoint at step %d: %s", step, path)
        return path

    def metrics(self, trainer: L.Trainer | None = None) -> list[dict[str, str]]:
        """The training curves so far: the earlier runs', then this run's (rank 0, after its logger saved); with
        ``trainer``, at a step's end, also that step's row (Lightning logs it only after the step's callbacks)."""
        rows = [*self.earlier_metrics, *read_metrics(self.logged_metrics)]
        # Trainer.__init__ sets log_every_n_steps (through its logger connector) without declaring it
        if trainer is not None and trainer.global_step % trainer.log_every_n_steps == 0:  # type: ignore[attr-defined]
            values = {
                key: str(float(value)) for key, value in trainer.callback_metrics.items() if key.startswith("train_")
            }
            rows.append({"epoch": str(trainer.current_epoch), "step": str(trainer.global_step - 1), **values})
        return rows

    def state_dict(self) -> dict[str, Any]:
        states = [random_state()]
        state: dict[str, Any] = {}
        if self._trainer is not None:
            states = gather_to_all(self._trainer, states[0])
            # saved at a step's end: its batch counts as taken (Lightning's "processed")
            # Lightning declares the tracker as _ReadyCompletedTracker; a _BatchProgress holds a _ProcessedTracker
            taken = self._trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
            state["data"] = {"epoch": self._trainer.current_epoch, "batches": taken}
            state["precision"] = str(self._trainer.precision)  # the value the ranks trained at
        return {"random_state": states, **state}

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored at once: Lightning makes the resumed epoch's data iterator (its seed is drawn from torch's
        # generator) before any hook after this one; the uninterrupted run makes it at that epoch's start.
        states = state_dict.get("random_state")
        if states and self._trainer is not None:
            set_random_state(states[self._trainer.global_rank])
        data = state_dict.get("data")
        if data is not None and self.resume_data_at is not None:
            self.resume_data_at(data["epoch"], data["batches"])
