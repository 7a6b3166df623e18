"""What the user sees: a progress line, validation results, and the run's records in the work directory.

  ``metrics.jsonl``  one JSON object per logged train interval and per evaluation (appended across resumes;
                     a value that is not finite is written as null), each with ``time`` (UTC, ISO 8601) and
                     ``elapsed_s`` (seconds since this start began)
  ``tensorboard/``   the same scalars for TensorBoard (tensorboardX)
  ``loss.png``       train and validation loss curves of the whole run (every start), drawn at the end
The same records go to every writer ``config.report.trackers`` names (``training.trackers``: metrics.jsonl,
TensorBoard, MLflow, Weights & Biases). Only process 0 writes; every process keeps the numbers. A step
recorded twice (a resume repeats the steps after the last checkpoint, bit for bit) counts once in
metrics.jsonl, by its latest record.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import sys
import time

from training import trackers


def read_records(path: str) -> dict[str, dict[int, dict]]:
  """The records of a ``metrics.jsonl`` by kind and step (a step recorded twice keeps its latest record).

  A line that is not JSON (a run killed mid-write) is skipped.
  """
  by_kind: dict[str, dict[int, dict]] = {}
  if not os.path.exists(path):
    return by_kind
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
        by_kind.setdefault(record["kind"], {})[int(record["step"])] = record
      except (ValueError, KeyError, TypeError):
        continue
  return by_kind


def _finite_or_none(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _fmt_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _same_file(stream, fd: int) -> bool:
  """Whether ``stream`` writes where file descriptor ``fd`` does (one terminal, one pipe, one file)."""
  try:
    a, b = os.fstat(stream.fileno()), os.fstat(fd)
  except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
    return False
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class Reporter:
  """Progress (a line every ``log_every`` steps; on a terminal also a ``\\r`` line redrawn every step) and files."""

  def __init__(self, workdir: str, *, total_steps: int, tokens_per_step: int, log_every: int,
               primary: bool = True, stream=None, open_writers=None):
    """``open_writers()``: the ``training.trackers`` writers of the run, opened on process 0 only (default:
    metrics.jsonl and TensorBoard in ``workdir``)."""
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.log_every = max(log_every, 1)
    self.primary = primary
    self.stream = stream or sys.stdout
    self.tty = self.primary and hasattr(self.stream, "isatty") and self.stream.isatty()
    self._line_open = False
    self._phase_open = False       # a "doing X ..." line waiting for its time
    self._last_len = 0             # length of the progress line redrawn in place on a terminal (0: none open)
    self._shares_stderr = self.primary and _same_file(self.stream, 2)
    self.started = time.monotonic()
    self._interval = []            # train losses since the last record
    self._last_time = None
    self._last_step = None
    self._skip_interval = True
    self._rate_steps = 0           # steps and seconds after the first (compiling) step, for tokens/s
    self._rate_seconds = 0.0
    self.writers = []
    self._closed = False
    # Earlier starts of this run (every process reads them, so that all agree on what is left to do).
    path = os.path.join(workdir, "metrics.jsonl")
    earlier = read_records(path)
    self.train_curve = [(s, r["loss"]) for s, r in sorted(earlier.get("train", {}).items())]
    self.eval_curve = [(s, r["loss"]) for s, r in sorted(earlier.get("eval", {}).items())]
    self._last_train_record = max(earlier.get("train", {}).items(), default=(None, None))[1]
    if primary:
      os.makedirs(workdir, exist_ok=True)
      self._png = os.path.join(workdir, "loss.png")
      self.writers = (open_writers or (lambda: [trackers.JsonlWriter(path), trackers.TensorBoardWriter(
          os.path.join(workdir, "tensorboard"))]))()

  # Rates ----------------------------------------------------------------------------------------------

  @property
  def step_time(self) -> float:
    """Mean seconds per step, excluding the first step of the run (compilation)."""
    return self._rate_seconds / self._rate_steps if self._rate_steps else float("nan")

  @property
  def tokens_per_second(self) -> float:
    return self.tokens_per_step / self.step_time if self._rate_steps else float("nan")

  @property
  def last_train_loss(self) -> float:
    """The loss of the latest logged step (of this start or an earlier one), or NaN."""
    record = self._last_train_record or {}
    loss = record.get("last_loss")
    return float(loss) if loss is not None else float("nan")

  def has_evaluation(self, step: int) -> bool:
    return any(s == step for s, _ in self.eval_curve)

  def mark_start(self, step: int) -> None:
    """Restarts the clock; the next interval (compilation, a pause) is not counted in the rates."""
    self._last_time, self._last_step = time.perf_counter(), step
    self._skip_interval = True

  # Output ---------------------------------------------------------------------------------------------

  def elapsed(self) -> float:
    """Seconds since this start began (the reporter is made at the start of the set-up)."""
    return time.monotonic() - self.started

  @contextlib.contextmanager
  def phase(self, text: str, *, hint: str = "", xla: bool = False):
    """``text ... 41.2 s`` around a start-up phase (``... failed after 3.1 s`` when it raises); ``hint``
    (a callable's result or a string) follows the time.

    ``xla``: the phase compiles or runs XLA programs, whose C++ warnings go straight to file descriptor 2.
    Where that is where this output goes too (a terminal, ``2>&1``), the line ``text ...`` ends at once
    and the time comes on a line of its own, ``text ... 41.2 s``, so a warning never lands inside a line."""
    self._end_phase()
    if self.tty and self._last_len:   # the progress line redrawn in place: it ends here
      self.stream.write("\n")
      self._last_len = 0
    own_line = xla and self._shares_stderr
    if self.primary:
      self.stream.write(f"{text} ..." + ("\n" if own_line else ""))
      self.stream.flush()
      self._phase_open = not own_line
    start = time.monotonic()
    lead = f"{text} ..." if own_line and self.primary else ""
    try:
      yield
    except BaseException:
      self._end_phase(f" failed after {time.monotonic() - start:.1f} s", lead)
      raise
    after = hint() if callable(hint) else hint
    self._end_phase(f" {time.monotonic() - start:.1f} s" + (f"  ({after})" if after else ""), lead)

  def end_line(self) -> None:
    """Ends an open phase line (another thread is about to print)."""
    self._end_phase()

  def _end_phase(self, text: str = "", lead: str = "") -> None:
    """Ends an open phase line with ``text``; or, with ``lead`` (a phase whose line ended at once), writes
    ``lead + text`` as a line of its own."""
    if self.primary and (self._phase_open or lead):
      self.stream.write(lead + text + "\n")
      self.stream.flush()
    self._phase_open = False

  def _print(self, text: str, *, transient: bool = False) -> None:
    if not self.primary:
      return
    self._end_phase()
    if self.tty:
      pad = " " * max(0, self._last_len - len(text))
      self.stream.write("\r" + text + pad + ("" if transient else "\n"))
      self._last_len = len(text) if transient else 0
    elif not transient:
      self.stream.write(text + "\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    """A line that stays (the progress line is redrawn under it)."""
    self._print(text)

  def _record(self, record: dict) -> None:
    if not self.primary:
      return
    record = dict(time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  elapsed_s=round(self.elapsed(), 3), **record)
    record = {k: _finite_or_none(v) for k, v in record.items()}
    for writer in self.writers:
      writer.write(record)

  def train_step(self, step: int, metrics: dict, *, recipe: str, nonfinite_note: str = "") -> None:
    """``metrics`` of the step that ended at ``step`` (1-based count of steps done), on the host."""
    now = time.perf_counter()
    if self._last_time is not None and not self._skip_interval and step > self._last_step:
      self._rate_steps += step - self._last_step
      self._rate_seconds += now - self._last_time
    self._skip_interval = False
    self._last_time, self._last_step = now, step
    loss = float(metrics["loss"])
    if math.isfinite(loss):
      self._interval.append(loss)
    if self._rate_steps:
      remaining = (self.total_steps - step) * self.step_time
      rates = (f"{self.tokens_per_second:9,.0f} tok/s  {1000 * self.step_time:7.1f} ms/step  "
               f"ETA {_fmt_duration(remaining)}")
    else:  # the first interval after a start, an evaluation or a save is not counted: no rate yet
      rates = f"{'(no rate yet)':>38}"
    # The loss shown is the one metrics.jsonl records: the mean over the steps since the last record.
    mean = sum(self._interval) / len(self._interval) if self._interval else float("nan")
    window = f"mean of last {len(self._interval)}"
    clock = f"{datetime.datetime.now().strftime('%H:%M:%S')} +{self.elapsed():.0f}s"
    mtp = f"  mtp {float(metrics['mtp/loss']):7.4f}" if "mtp/loss" in metrics else ""   # this step's, all depths
    # Pairs expert parallelism dropped this step (moe_receive_factor), summed over the E blocks: shown when any.
    dropped = sum(float(v) for k, v in metrics.items() if k.startswith("moe/") and k.endswith("/dropped"))
    drops = f"  moe dropped {dropped:,.0f} pairs" if dropped else ""
    line = (f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {mean:7.4f} ({window}){mtp}{drops}  "
            f"{rates}  [{recipe}]  {clock}{nonfinite_note}")
    logged = step % self.log_every == 0 or step == self.total_steps
    if logged or self.tty:
      self._print(line, transient=not logged)  # on a terminal every step redraws; logged steps stay
    if logged:
      self._interval = []
      self.train_curve.append((step, mean))
      record = dict(kind="train", step=step, loss=mean, last_loss=loss, grad_norm=float(metrics["grad_norm"]),
                    lr=float(metrics["lr"]), nonfinite_total=int(metrics["nonfinite_total"]),
                    tokens_per_second=self.tokens_per_second, step_time=self.step_time, recipe=recipe,
                    **{k: float(v) for k, v in metrics.items()
                       if k.startswith(("moe/", "mtp/")) or k == "objective"})   # MoE blocks, MTP depths
      self._last_train_record = record
      self._record(record)

  def evaluation(self, step: int, loss: float, bits_per_byte: float | None) -> None:
    self.eval_curve.append((step, loss))
    bpb = f"  {bits_per_byte:.4f} bits/byte" if bits_per_byte is not None else ""
    self._print(f"step {step}: validation loss {loss:.4f}{bpb}")
    self._record(dict(kind="eval", step=step, loss=loss, bits_per_byte=bits_per_byte))

  def close(self, title: str = "", *, draw: bool = True) -> str | None:
    """Writes loss.png (when there is a curve and ``draw``) and closes the files; returns the PNG's path. Once."""
    if not self.primary or self._closed:
      return None
    self._closed = True
    self._end_phase()
    path = None
    if not draw:
      train_curve = eval_curve = []
    else:
      train_curve = sorted(dict(self.train_curve).items())  # a step repeated after a resume counts once
      eval_curve = sorted(dict(self.eval_curve).items())
      train_curve = [(s, l) for s, l in train_curve if l is not None and math.isfinite(l)]
      eval_curve = [(s, l) for s, l in eval_curve if l is not None and math.isfinite(l)]
    if train_curve or eval_curve:
      import matplotlib  # pylint: disable=g-import-not-at-top
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
      fig, ax = plt.subplots(figsize=(7, 4))
      if train_curve:
        ax.plot(*zip(*train_curve), label="train")
      if eval_curve:
        ax.plot(*zip(*eval_curve), "o-", label="validation")
      ax.set_xlabel("step")
      ax.set_ylabel("loss (nats/token)")
      ax.set_title(title)
      ax.grid(alpha=0.3)
      ax.legend()
      fig.tight_layout()
      fig.savefig(self._png, dpi=100)
      plt.close(fig)
      path = self._png
    errors = []
    for writer in self.writers:   # every one closed; the first failure raised after
      try:
        writer.close()
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    if errors:
      raise errors[0]
    return path
