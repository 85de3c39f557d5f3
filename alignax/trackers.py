"""Experiment trackers: Weights & Biases and MLflow beside ``metrics.jsonl`` and TensorBoard.

``logging.wandb`` and ``logging.mlflow`` (null: off) each add a :class:`~alignax.metrics.MetricWriter`
that receives every figure the run writes (training, eval, data counts, and the monitor's
alarm events, which are metrics too), and the run's whole config once, flattened to dotted
keys (wandb's run config; MLflow's params). Neither package is a dependency of alignax:
``pip install 'alignax[trackers]'`` (``make install`` includes it). Each works offline:

- wandb ``mode: offline`` (the default) writes its run folder under ``<output_dir>/wandb``
  for a later ``wandb sync``; ``online`` needs ``WANDB_API_KEY`` and the network.
- MLflow's ``tracking_uri`` defaults to a file store under ``<output_dir>/mlruns``
  (``mlflow ui --backend-store-uri <output_dir>/mlruns``); any URI MLflow takes works.

A resumed run continues the same tracker run: its id is kept in
``<output_dir>/trackers.json``, written when the run starts. A run stopped between checkpoints
repeats the steps since its last checkpoint exactly when resumed: the figures a tracker already
holds with the same value are not sent again (MLflow would keep both equal values of a step),
others are (:class:`SentLog`: a step cut short, a resume with changes). An online wandb run
refuses steps below its last, so there only the offline run folder and MLflow keep figures a
resumed run sends for earlier steps. A tracker run ends as the run did
(:meth:`MultiWriter.record_outcome <alignax.metrics.MultiWriter.record_outcome>`):
``finished``, ``killed`` (stopped by SIGTERM or SIGINT after saving, to be resumed) or
``failed`` (an error, an alarm's stop): MLflow's run status ``FINISHED`` / ``KILLED`` /
``FAILED``; wandb's exit code 0 or 1 (its ``crashed``/``failed`` state). An object-store
``output_dir`` is refused unless MLflow has a ``tracking_uri`` of its own and wandb is off:
both write local files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from alignax import config as config_io
from alignax import paths
from alignax.config import ConfigError
from alignax.metrics import JsonlWriter, read_jsonl

TRACKER_IDS = "trackers.json"


@dataclasses.dataclass(frozen=True)
class WandbSection:
    """``logging.wandb``: ``project``, ``entity`` (null: the account's default), ``name`` (null:
    the output_dir's base name), ``mode`` (``offline``: a run folder to sync later;
    ``online``: stream to the server), ``tags``."""

    project: str = "alignax"
    entity: str | None = None
    name: str | None = None
    mode: Literal["offline", "online"] = "offline"
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MlflowSection:
    """``logging.mlflow``: ``tracking_uri`` (null: a file store under ``<output_dir>/mlruns``),
    ``experiment``, ``run_name`` (null: the output_dir's base name)."""

    tracking_uri: str | None = None
    experiment: str = "alignax"
    run_name: str | None = None


def flat(tree: Any) -> dict[str, Any]:
    """A nested config dict as ``{dotted.key: scalar}`` (lists as their JSON text)."""
    return {k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in config_io.dotted(tree).items()}


def _import(package: str, key: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{key} needs the {package} package, which is not installed: "
                          "pip install 'alignax[trackers]' (make install includes it)") from None


OUTCOMES = ("finished", "killed", "failed")


class TrackerIds:
    """The tracker run ids of an output directory (``trackers.json``), so a resumed run logs
    into the run it started."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, TRACKER_IDS)
        target = paths.as_path(self.path)
        self.ids: dict[str, str] = json.loads(target.read_text()) if target.exists() else {}

    def remember(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        paths.write_text(self.path, json.dumps(self.ids, indent=1))


class SentLog:
    """What a tracker was sent, ``<output_dir>/<tracker>_sent.jsonl`` (a
    :class:`~alignax.metrics.JsonlWriter` file), so that a resumed run leaves out the figures
    it repeats: those the run's earlier processes sent at the same step with the same value.
    A figure that differs (a resume with changes, from an earlier step), or that no earlier
    process sent (a step cut short, an evaluation at the start), is sent."""

    def __init__(self, output_dir: str, tracker: str):
        path = os.path.join(output_dir, f"{tracker}_sent.jsonl")
        rows = read_jsonl(path) if paths.as_path(path).exists() else []
        self._earlier = {(int(row["step"]), key): value for row in rows for key, value in row.items()
                         if key not in ("step", "time")}
        self._log = JsonlWriter(path)

    def unsent(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """The figures of ``metrics`` at ``step`` that no earlier process sent with this value."""
        def sent_before(key: str, value: float) -> bool:
            earlier = self._earlier.get((step, key))
            return earlier is not None and (earlier == float(value) or (math.isnan(earlier) and math.isnan(value)))

        return {key: float(value) for key, value in metrics.items() if not sent_before(key, float(value))}

    def record(self, step: int, figures: Mapping[str, float]) -> None:
        """``figures`` went out at ``step`` (after the tracker took them)."""
        if figures:
            self._log.write(step, figures)

    def close(self) -> None:
        self._log.close()


def _checked_outcome(outcome: str) -> str:
    if outcome not in OUTCOMES:
        raise ValueError(f"a run's outcome is one of {', '.join(OUTCOMES)}; got {outcome!r}")
    return outcome


class WandbWriter:
    """Figures into a wandb run (``wandb.log`` at the run's step)."""

    def __init__(self, section: WandbSection, output_dir: str, config: Mapping[str, Any], ids: TrackerIds):
        wandb = _import("wandb", "logging.wandb")
        directory = os.path.join(output_dir, "wandb")
        os.makedirs(directory, exist_ok=True)
        run_id = ids.ids.get("wandb") or uuid.uuid4().hex[:8]  # wandb ids: lowercase letters and digits
        self._run = wandb.init(project=section.project, entity=section.entity, mode=section.mode, id=run_id,
                               resume="allow", name=section.name or os.path.basename(os.path.normpath(output_dir)),
                               tags=list(section.tags), dir=output_dir, config=flat(config),
                               settings=wandb.Settings(silent=True, console="off"))
        ids.remember("wandb", run_id)
        self._sent, self.outcome = SentLog(output_dir, "wandb"), "finished"
        self.run_dir = self._run.dir  # <output_dir>/wandb/<offline-run-...>/files

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        fresh = self._sent.unsent(int(step), metrics)
        if fresh:
            self._run.log(fresh, step=int(step))
            self._sent.record(int(step), fresh)

    def record_outcome(self, outcome: str) -> None:
        self.outcome = _checked_outcome(outcome)

    def close(self) -> None:
        self._sent.close()
        self._run.finish(exit_code=0 if self.outcome == "finished" else 1)


class MlflowWriter:
    """Figures into an MLflow run (``log_metrics`` at the run's step)."""

    def __init__(self, section: MlflowSection, output_dir: str, config: Mapping[str, Any], ids: TrackerIds):
        _import("mlflow", "logging.mlflow")
        from mlflow.tracking import MlflowClient

        uri = section.tracking_uri
        if uri is None:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; it is the
            # one store that needs no server or database, which a default must not
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file://" + os.path.abspath(os.path.join(output_dir, "mlruns"))
        self._client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        run_id = ids.ids.get("mlflow")
        if run_id is None:
            experiment = self._client.get_experiment_by_name(section.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(section.experiment))
            run = self._client.create_run(experiment_id, run_name=section.run_name or os.path.basename(
                os.path.normpath(output_dir)))
            run_id = run.info.run_id
            params = flat(config)
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
                from mlflow.entities import Param

                chunk = list(params.items())[start:start + 100]
                self._client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in chunk])
            ids.remember("mlflow", run_id)
        else:
            self._client.update_run(run_id, status="RUNNING")  # a resumed run is running again
        self.run_id, self._sent, self.outcome = run_id, SentLog(output_dir, "mlflow"), "finished"

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = self._sent.unsent(int(step), metrics)
        batch = [Metric(_mlflow_key(k), v, now, int(step)) for k, v in fresh.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self._client.log_batch(self.run_id, metrics=batch[start:start + 1000])
        self._sent.record(int(step), fresh)

    def record_outcome(self, outcome: str) -> None:
        self.outcome = _checked_outcome(outcome)

    def close(self) -> None:
        self._sent.close()
        self._client.set_terminated(self.run_id, status=self.outcome.upper())


def _mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, ``_ - . / space`` and ``:`` in a metric name; alignax's
    figures use those but for ``@`` (``pass@k``) and ``%``: spelt out."""
    return key.replace("@", "_at_").replace("%", "pct")


def tracker_writers(logging_section, output_dir: str, run_config: Any) -> list[Any]:
    """The writers of the trackers ``logging_section`` turns on (none when both are null);
    ``run_config``: the run's config, logged once by each."""
    writers: list[Any] = []
    if logging_section.wandb is None and logging_section.mlflow is None:
        return writers
    config = config_io.to_dict(run_config)  # only when a tracker logs it
    mlflow_local = logging_section.mlflow is not None and logging_section.mlflow.tracking_uri is None
    if paths.is_remote(output_dir) and (logging_section.wandb is not None or mlflow_local):
        which = "logging.wandb" if logging_section.wandb is not None else "logging.mlflow"
        raise ConfigError(f"{which} with output_dir={output_dir}: the tracker writes local files (a wandb run folder, "
                          "an MLflow file store), which would stay on this machine; set logging.mlflow.tracking_uri "
                          "to a server or database, or use a local output_dir")
    ids = TrackerIds(output_dir)
    try:
        if logging_section.wandb is not None:
            writers.append(WandbWriter(logging_section.wandb, output_dir, config, ids))
        if logging_section.mlflow is not None:
            writers.append(MlflowWriter(logging_section.mlflow, output_dir, config, ids))
    except BaseException:
        for writer in writers:  # a tracker run already started is ended, not left open
            writer.close()
        raise
    return writers


__all__ = ["MlflowSection", "MlflowWriter", "OUTCOMES", "SentLog", "TRACKER_IDS", "TrackerIds", "WandbSection", "WandbWriter", "flat",
           "tracker_writers"]
