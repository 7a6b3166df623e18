"""Trackers (training.trackers): a run's metrics in MLflow's local file store and a W&B offline run, read back
and compared with metrics.jsonl; a resume continues the same runs; the config's errors. No network."""
import functools
import glob
import json
import os
import struct

import pytest
from ml_collections import config_dict

import train_runs
from training import config as config_lib
from training import report as report_lib
from training import trackers
from training import trainer
from training.errors import ConfigError

mlflow = pytest.importorskip("mlflow")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def _section(names="jsonl,tensorboard,mlflow,wandb", **kw):
  return config_dict.ConfigDict(dict(dict(trackers=names, mlflow_uri="", mlflow_experiment="", wandb_project="",
                                          wandb_mode="offline"), **kw))


def _mlflow_history(workdir, key):
  """{step: [values]} of the metric ``key`` of the work directory's MLflow run, from its local store."""
  run_id = json.load(open(os.path.join(workdir, trackers.IDS_FILE)))["mlflow_run_id"]
  client = mlflow.MlflowClient(tracking_uri="file://" + os.path.join(workdir, "mlruns"))
  out = {}
  for metric in client.get_metric_history(run_id, key):
    out.setdefault(metric.step, []).append(metric.value)
  return out


def _wandb_history(path, kinds=None):
  """The history rows of a W&B ``.wandb`` file (a LevelDB-style log of protobuf Records: a 7-byte file header,
  then 32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle /
  4 last). ``kinds``: a list that gets every record's type, in order."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:7]
  block, pos, pending, rows = 32768, 7, b"", []
  while pos + 7 <= len(data):
    if block - pos % block < 7:   # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_pb.Record()
      record.ParseFromString(pending)
      pending = b""
      if kinds is not None:
        kinds.append(record.WhichOneof("record_type"))
      if record.WhichOneof("record_type") == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
  return rows


def test_a_run_logs_its_metrics_to_mlflow_and_wandb_offline(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")   # nothing leaves the machine, whatever the config says
  for i in range(12):
    (tmp_path / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (i + 20))
  workdir = str(tmp_path / "run")
  config = train_runs.run_config(steps=2, **{"data.sources": str(tmp_path / "*.txt"), "checkpoint.every_steps": 0,
                                            "eval.batches": 1, "eval.every_steps": 2,
                                            "report.trackers": "jsonl,tensorboard,mlflow,wandb"})
  trainer.train_and_evaluate(config, workdir)
  records = train_runs.read_metrics(workdir)
  train = {r["step"]: r for r in records if r["kind"] == "train"}
  evals = {r["step"]: r for r in records if r["kind"] == "eval"}
  assert sorted(train) == [1, 2] and sorted(evals) == [2]

  assert _mlflow_history(workdir, "train/loss") == {s: [r["loss"]] for s, r in train.items()}
  assert _mlflow_history(workdir, "train/grad_norm") == {s: [r["grad_norm"]] for s, r in train.items()}
  assert _mlflow_history(workdir, "eval/loss") == {2: [evals[2]["loss"]]}

  files = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(files) == 1, files
  rows = [r for r in _wandb_history(files[0]) if "step" in r]
  assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == [(s, r["loss"]) for s, r in
                                                                                sorted(train.items())]
  assert [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r] == [(2, evals[2]["loss"])]


def test_a_resume_continues_the_same_mlflow_and_wandb_runs(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  workdir = str(tmp_path)
  metrics = dict(loss=2.5, grad_norm=1.0, lr=1e-3, nonfinite_total=0)
  for start, step in enumerate((1, 2)):
    writers = functools.partial(trackers.open_writers, _section("jsonl,mlflow,wandb"), workdir, name="resumed",
                                config={"start": start})
    reporter = report_lib.Reporter(workdir, total_steps=2, tokens_per_step=8, log_every=1, open_writers=writers)
    reporter.train_step(step, dict(metrics, loss=metrics["loss"] - step), recipe="bf16")
    reporter.close(draw=False)
  assert _mlflow_history(workdir, "train/loss") == {1: [1.5], 2: [0.5]}
  client = mlflow.MlflowClient(tracking_uri="file://" + os.path.join(workdir, "mlruns"))
  assert len(client.search_runs([client.get_experiment_by_name("resumed").experiment_id])) == 1
  run_id = json.load(open(os.path.join(workdir, trackers.IDS_FILE)))["wandb_run_id"]
  import wandb  # pylint: disable=g-import-not-at-top
  wandb.teardown()   # the service's streams closed: the transaction logs written out before they are read
  files = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))
  assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files), files
  kinds = {f: [] for f in files}
  losses = {f: [(r["step"], r["train/loss"]) for r in _wandb_history(f, kinds[f]) if "train/loss" in r] for f in files}
  logs = {f: open(os.path.join(os.path.dirname(f), "logs", "debug-internal.log")).read()[-1500:] for f in files}
  assert sorted(losses.values()) == [[(1, 1.5)], [(2, 0.5)]], (losses, kinds, logs)   # one offline run per start


def test_the_trackers_config_is_checked_before_the_run(monkeypatch):
  with pytest.raises(ConfigError, match="unknown tracker 'neptune'"):
    trackers.check(_section("jsonl,neptune"))
  with pytest.raises(ConfigError, match="leaves out 'jsonl'.*'jsonl,mlflow'"):
    trackers.check(_section("mlflow"))
  with pytest.raises(ConfigError, match="wandb_mode='cloud'"):
    trackers.check(_section(wandb_mode="cloud"))
  real = trackers.importlib.util.find_spec
  monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
  with pytest.raises(ConfigError, match=r"'wandb' package is not installed; pip install 'fp4jax\[wandb\]'"):
    trackers.check(_section("jsonl,wandb"))
  config = train_runs.run_config(steps=2, **{"report.trackers": "jsonl,wandb"})
  with pytest.raises(ConfigError, match=r"fp4jax\[wandb\]"):
    config_lib.validate(config)


def test_an_mlflow_uri_may_be_a_directory_or_any_uri(tmp_path):
  assert trackers._mlflow_uri("", str(tmp_path)) == (tmp_path / "mlruns").as_uri()
  assert trackers._mlflow_uri(str(tmp_path / "store"), "/elsewhere") == (tmp_path / "store").as_uri()
  assert trackers._mlflow_uri("sqlite:///mlflow.db", "/elsewhere") == "sqlite:///mlflow.db"
  assert trackers._mlflow_uri("http://127.0.0.1:5000", "/elsewhere") == "http://127.0.0.1:5000"
