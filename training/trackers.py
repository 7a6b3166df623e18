"""Where a run's metrics go: the writers ``config.report.trackers`` names (comma-separated).

  jsonl        ``<workdir>/metrics.jsonl``: the run's own record (a resume reads which evaluations are done
               from it, ``loss.png`` is drawn from it), so every list names it
  tensorboard  ``<workdir>/tensorboard/`` (tensorboardX)
  mlflow       an MLflow run (``pip install 'fp4jax[mlflow]'``): ``config.report.mlflow_uri``, empty for the
               local file store ``<workdir>/mlruns``; experiment ``config.report.mlflow_experiment``
               (empty: ``config.name``)
  wandb        a Weights & Biases run (``pip install 'fp4jax[wandb]'``) in ``<workdir>/wandb/``;
               ``config.report.wandb_mode`` "offline" (the default: no network, ``wandb sync`` uploads it
               later) or "online"; project ``config.report.wandb_project`` (empty: ``config.name``)

Every writer takes the same records (``Writer.write``): a dict with ``kind`` ("train" or "eval"), ``step``
(steps done), ``time`` and numbers (None where a value was not finite). MLflow and W&B get each number as
the metric ``<kind>/<name>`` at its step. A resume continues the same MLflow and W&B runs: their ids are kept
in ``<workdir>/trackers.json``. Only process 0 writes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time
import urllib.parse
import uuid
from typing import Protocol

from training.errors import ConfigError

# name -> (the module it imports, the pip extra that installs it)
TRACKERS = {"jsonl": (None, None), "tensorboard": ("tensorboardX", None), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}
IDS_FILE = "trackers.json"
WANDB_MODES = ("offline", "online")
_NOT_METRICS = ("kind", "step", "time")


class Writer(Protocol):
  """One destination of the run's records."""
  where: str   # where to look: a path, or a run id and its store

  def write(self, record: dict) -> None:
    """One train interval or evaluation (see the module docstring)."""

  def close(self) -> None:
    """Flushes and ends the destination; once."""


def parse(spec: str) -> list[str]:
  """The tracker names of ``config.report.trackers``; ConfigError for an unknown name, a list without
  "jsonl", or a tracker whose package is not installed (naming the pip extra)."""
  names = [n.strip().lower() for n in str(spec).split(",") if n.strip()]
  for name in names:
    if name not in TRACKERS:
      raise ConfigError(f"config.report.trackers={spec!r}: unknown tracker {name!r}; use a comma-separated list "
                        f"of {list(TRACKERS)}, e.g. 'jsonl,tensorboard,mlflow'")
  if "jsonl" not in names:
    raise ConfigError(f"config.report.trackers={spec!r} leaves out 'jsonl': metrics.jsonl is the run's own record "
                      "(a resume reads which evaluations are done from it, loss.png is drawn from it); use "
                      f"{','.join(['jsonl'] + names)!r}")
  for name in names:
    module, extra = TRACKERS[name]
    if module is not None and importlib.util.find_spec(module) is None:
      fix = f"pip install 'fp4jax[{extra}]'" if extra else f"pip install {module}"
      raise ConfigError(f"config.report.trackers names {name!r}, but the {module!r} package is not installed; "
                        f"{fix}, or leave {name!r} out of config.report.trackers")
  return list(dict.fromkeys(names))


def check(section) -> None:
  """ConfigError unless ``config.report`` names installed trackers and a known W&B mode."""
  parse(section.trackers)
  if section.wandb_mode not in WANDB_MODES:
    raise ConfigError(f"config.report.wandb_mode={section.wandb_mode!r}; use 'offline' (written in the work "
                      "directory, uploaded later with `wandb sync`) or 'online'")


def open_writers(section, workdir: str, *, name: str, config: dict) -> list[Writer]:
  """The writers ``section`` (``config.report``) names, for the run ``name`` in ``workdir``; ``config``: the
  run's plain config (MLflow keeps it as the artifact config.json, W&B as the run's config)."""
  ids = _RunIds(workdir)
  writers = []
  try:
    for tracker in parse(section.trackers):
      if tracker == "jsonl":
        writers.append(JsonlWriter(os.path.join(workdir, "metrics.jsonl")))
      elif tracker == "tensorboard":
        writers.append(TensorBoardWriter(os.path.join(workdir, "tensorboard")))
      elif tracker == "mlflow":
        writers.append(MlflowWriter(_mlflow_uri(section.mlflow_uri, workdir), section.mlflow_experiment or name,
                                    run_name=os.path.basename(workdir), config=config, ids=ids))
      else:
        writers.append(WandbWriter(workdir, section.wandb_project or name, mode=section.wandb_mode,
                                   run_name=os.path.basename(workdir), config=config, ids=ids))
  except BaseException:
    for writer in writers:
      writer.close()
    raise
  return writers


def metrics(record: dict) -> dict[str, float]:
  """``{"<kind>/<name>": value}`` for every number of ``record`` (None, strings and the step left out)."""
  return {f"{record['kind']}/{k}": float(v) for k, v in record.items()
          if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _RunIds:
  """``<workdir>/trackers.json``: the MLflow and W&B run ids of this work directory, so a resume continues them
  (a missing or unreadable file: new runs, whose ids it then holds)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, IDS_FILE)
    try:
      with open(self.path, encoding="utf-8") as f:
        ids = json.load(f)
    except (OSError, ValueError):
      ids = {}
    self.ids = {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}

  def get(self, key: str) -> str | None:
    return self.ids.get(key)

  def put(self, key: str, value: str) -> None:
    self.ids[key] = value
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.ids, f, indent=2)
    os.replace(tmp, self.path)


class JsonlWriter:
  """One JSON object per line, appended (a value that is not finite is already None: null)."""

  def __init__(self, path: str):
    self._file = open(path, "a", encoding="utf-8")
    self.where = path

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class TensorBoardWriter:
  """Each number as the scalar ``<kind>/<name>`` at its step."""

  def __init__(self, logdir: str):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._writer = SummaryWriter(logdir)
    self.where = logdir

  def write(self, record: dict) -> None:
    for key, value in metrics(record).items():
      self._writer.add_scalar(key, value, record["step"])

  def close(self) -> None:
    self._writer.close()


def _mlflow_uri(uri: str, workdir: str) -> str:
  """The tracking URI: ``uri`` as given when it has a scheme (``file:``, ``sqlite:``, ``http:``), a local
  directory's ``file:`` URI when it is a path, ``<workdir>/mlruns`` when empty."""
  if len(urllib.parse.urlparse(uri).scheme) > 1:   # one letter: a Windows drive, a path
    return uri
  return pathlib.Path(os.path.abspath(os.path.expanduser(uri or os.path.join(workdir, "mlruns")))).as_uri()


class MlflowWriter:
  """An MLflow run through ``MlflowClient`` (no global active run): metrics by ``log_batch``, the config as
  the artifact config.json. MLflow 3 keeps its file store (a ``file:`` URI) in maintenance mode and refuses it
  unless ``MLFLOW_ALLOW_FILE_STORE`` is set; for a ``file:`` URI it is set to true here, unless already set."""

  def __init__(self, uri: str, experiment: str, *, run_name: str, config: dict, ids: _RunIds):
    if uri.startswith("file:"):
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Metric  # pylint: disable=g-import-not-at-top
    from mlflow.exceptions import MlflowException  # pylint: disable=g-import-not-at-top
    from mlflow.tracking import MlflowClient  # pylint: disable=g-import-not-at-top
    self._metric, self._missing = Metric, MlflowException
    self._client = MlflowClient(tracking_uri=uri)
    self.run_id = self._continued(ids.get("mlflow_run_id"))
    if self.run_id is None:
      found = self._client.get_experiment_by_name(experiment)
      experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
      self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
      ids.put("mlflow_run_id", self.run_id)
    self._client.log_dict(self.run_id, config, "config.json")
    self.where = f"mlflow run {self.run_id} ({uri})"

  def _continued(self, run_id: str | None) -> str | None:
    """``run_id`` when this store holds it (a resume), reopened; else None."""
    if run_id is None:
      return None
    try:
      self._client.get_run(run_id)
    except self._missing:   # not in this store (report.mlflow_uri changed): a new run
      return None
    self._client.update_run(run_id, status="RUNNING")
    return run_id

  def write(self, record: dict) -> None:
    millis = int(time.time() * 1000)
    batch = [self._metric(key, value, millis, int(record["step"])) for key, value in metrics(record).items()]
    if batch:
      self._client.log_batch(self.run_id, metrics=batch)

  def close(self) -> None:
    self._client.set_terminated(self.run_id)


class WandbWriter:
  """A W&B run in ``<workdir>/wandb/`` (console capture off: the progress line stays the trainer's). The step
  is the metric ``step`` every other metric is plotted against, so a resume's repeated steps are accepted."""

  def __init__(self, workdir: str, project: str, *, mode: str, run_name: str, config: dict, ids: _RunIds):
    import wandb  # pylint: disable=g-import-not-at-top
    run_id = ids.get("wandb_run_id")
    if run_id is None:
      run_id = uuid.uuid4().hex[:16]
      ids.put("wandb_run_id", run_id)
    settings = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False,
                              x_save_requirements=False)
    self._run = wandb.init(project=project, id=run_id, name=run_name, resume="allow", mode=mode, dir=workdir,
                           config=config, allow_val_change=True, settings=settings)
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")
    run_dir = os.path.dirname(self._run.dir)   # <workdir>/wandb/<mode>-run-<time>-<id>; run.dir is its files/
    self.where = f"wandb {mode} run {run_id} ({run_dir})"

  def write(self, record: dict) -> None:
    values = metrics(record)
    if values:
      self._run.log({"step": int(record["step"]), **values})

  def close(self) -> None:
    self._run.finish()
