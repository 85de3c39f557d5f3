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
``<output_dir>/trackers.json``, written when the run starts, with the last step each tracker
was sent and the figures of that step it holds. A run stopped between checkpoints repeats the
steps since its last checkpoint exactly when resumed; those the tracker already holds are not
sent again (MLflow would keep both equal values of a step, and an online wandb run refuses steps
below its last), the rest of a step cut short are (:meth:`TrackerIds.unsent`). A tracker run ends as the run did
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
import os
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from alignax import config as config_io
from alignax import paths
from alignax.config import ConfigError

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
    """An output directory's ``trackers.json``: each tracker's run id, so that a resumed run
    logs into the run it started, and (under ``"sent"``) the step each tracker was last sent
    with the figures of that step, so that the steps a resumed run repeats are not sent twice."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, TRACKER_IDS)
        target = paths.as_path(self.path)
        stored = json.loads(target.read_text()) if target.exists() else {}
        self.sent: dict[str, list] = stored.pop("sent", {})
        self.ids: dict[str, str] = stored
        self._resume_marks = dict(self.sent)  # what the run's earlier processes sent

    def remember(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        self._save()

    def unsent(self, tracker: str, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """The figures of ``metrics`` at ``step`` to send to ``tracker``, recorded as sent.

        A resumed run repeats the steps from its checkpoint to where the previous process
        stopped: until a step goes past the last one that process sent, the steps before it
        are left out and, at it, the figures it sent. After that everything is sent (a
        monitor's rollback sends its steps again, with their new figures, as a new stretch)."""
        mark = self._resume_marks.get(tracker)
        if mark is not None:
            mark_step, mark_keys = mark
            if step < mark_step:
                return {}
            if step == mark_step:
                metrics = {k: v for k, v in metrics.items() if k not in set(mark_keys)}
            else:
                del self._resume_marks[tracker]
        last_step, last_keys = self.sent.get(tracker, (None, []))
        held = set(last_keys) if last_step == step else set()
        self.sent[tracker] = [int(step), sorted(held | set(metrics))]
        self._save()
        return dict(metrics)

    def _save(self) -> None:
        paths.write_text(self.path, json.dumps({**self.ids, "sent": self.sent}, indent=1))


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
        self._ids, self.outcome = ids, "finished"
        self.run_dir = self._run.dir  # <output_dir>/wandb/<offline-run-...>/files

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        fresh = self._ids.unsent("wandb", int(step), metrics)
        if fresh:
            self._run.log({k: float(v) for k, v in fresh.items()}, step=int(step))

    def record_outcome(self, outcome: str) -> None:
        self.outcome = _checked_outcome(outcome)

    def close(self) -> None:
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
        self.run_id, self._ids, self.outcome = run_id, ids, "finished"

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = self._ids.unsent("mlflow", int(step), metrics)
        batch = [Metric(_mlflow_key(k), float(v), now, int(step)) for k, v in fresh.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self._client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def record_outcome(self, outcome: str) -> None:
        self.outcome = _checked_outcome(outcome)

    def close(self) -> None:
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


__all__ = ["MlflowSection", "MlflowWriter", "OUTCOMES", "TRACKER_IDS", "TrackerIds", "WandbSection", "WandbWriter", "flat",
           "tracker_writers"]
