"""Metric sinks, the JAX profiler window, and MFU / memory figures for the training loop.

What it is: (1) sinks sharing one interface, `write(step, metrics)` and `close()`: JSONL file,
TensorBoard (tensorboardX), a Prometheus exporter and Weights & Biases (the optional extra
`posttrain[wandb]`; `WANDB_MODE=offline` works without network); `make_sinks` builds the configured ones;
(2) `Profiler`, which traces a window of steps with `jax.profiler` into a TensorBoard-readable
folder; (3) model FLOPs per token (for MFU), a measured matmul peak and live device memory.
What it is not: the progress bar ("console" is the loop's tqdm bar, so it has no sink object),
a metrics aggregator (sinks write exactly the dict they get), or the up-front memory estimate
(that is `posttrain.plan`, printed by the trainer before training).
References: MFU as in PaLM (Chowdhery et al. 2022, appendix B); Prometheus text exposition;
`wandb.init` / `wandb.Settings` (wandb 0.31).
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
import warnings
from typing import Protocol

import jax

from posttrain.errors import PosttrainError


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- sinks


class JsonlSink:
    """Appends {"step": step, **metrics} as one JSON line per write (append: a resumed run continues
    the same file). Non-finite values are written as NaN/Infinity, which Python's json reads back;
    a NaN loss is information worth keeping, not something to drop."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()  # a crash or kill keeps every line already logged

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """One scalar per metric name in a tensorboardX event file under `logdir`."""

    def __init__(self, logdir: str | os.PathLike):
        from tensorboardX import SummaryWriter  # imported lazily: only runs that ask for it pay

        self.writer = SummaryWriter(os.fspath(logdir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, float(value), int(step))
        self.writer.flush()  # log steps are seconds apart; flushing makes TensorBoard live

    def close(self) -> None:
        self.writer.close()


def _prom_name(name: str) -> str:
    return "posttrain_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class PrometheusSink:
    """A Prometheus exporter: one gauge per metric (`posttrain_<name>`) plus `posttrain_step`.

    Each sink owns its CollectorRegistry rather than the process-global one, so two runs (or
    tests) in one process do not collide on gauge names. `port=0` binds a free port; the bound
    port is `.port`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9400):
        import prometheus_client

        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._gauge_cls = prometheus_client.Gauge
        self._gauges: dict[str, object] = {}
        # prometheus_client >= 0.20 returns (server, thread); keep both to shut down cleanly.
        try:
            self._server, self._thread = prometheus_client.start_http_server(port, addr=host,
                                                                             registry=self.registry)
        except OSError as e:  # taken since the trainer's check_prometheus
            raise _bind_error(f"metrics.prometheus_host={host!r}, metrics.prometheus_port={port}", e) from None
        self.host, self.port = host, int(self._server.server_port)
        self._step = self._gauge("step")

    def _gauge(self, name: str):
        full = _prom_name(name)
        if full not in self._gauges:  # lazily: the metric names are known only at the first write
            self._gauges[full] = self._gauge_cls(full, f"posttrain metric {name}", registry=self.registry)
        return self._gauges[full]

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._gauge(name).set(float(value))
        self._step.set(int(step))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # stops serve_forever in the daemon thread
            self._server.server_close()  # releases the port for the next run
            self._thread.join(timeout=5)
            self._server = None


def check_prometheus(host: str, port: int) -> None:
    """Raise a PosttrainError unless the exporter could listen on host:port (a port another process holds,
    a host that does not resolve or is not an address of this machine). Trainers call it before the model
    loads, so such a mistake costs nothing; `PrometheusSink` reports the same when the port is taken later."""
    import socket

    where = f"metrics.prometheus_host={host!r}, metrics.prometheus_port={port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, OSError) as e:
        raise PosttrainError(f"{where}: cannot resolve the host ({getattr(e, 'strerror', None) or e}); set "
                             "metrics.prometheus_host to an address of this machine, e.g. 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's HTTP server does
        try:
            sock.bind(addr)
        except OSError as e:
            raise _bind_error(where, e) from None


def _bind_error(where: str, e: OSError) -> PosttrainError:
    import errno

    if e.errno == errno.EADDRINUSE:
        fix = ("the port is in use (another run's exporter?); set metrics.prometheus_port to a free port, or 0 to "
               "pick one")
    elif e.errno == errno.EADDRNOTAVAIL:
        fix = "the host is not an address of this machine; set metrics.prometheus_host, e.g. 127.0.0.1"
    else:
        fix = "pick another metrics.prometheus_port (ports below 1024 need privileges) or host"
    return PosttrainError(f"{where}: the Prometheus exporter cannot listen there ({e.strerror}); {fix}")


WANDB_MISSING = ("metrics.sinks names 'wandb' but the wandb package is not installed; install it with "
                 "`pip install 'posttrain[wandb]'` or drop 'wandb' from metrics.sinks")


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise PosttrainError(WANDB_MISSING) from None
    return wandb


class WandbSink:
    """A Weights & Biases run: every `write` is one `run.log(metrics, step=step)`, the run config is
    logged once at start, `close()` finishes the run.

    The run's name is the run folder's name, its files go under `<run_dir>/wandb/`, and
    `WANDB_MODE=offline` (read by wandb itself) writes them without any network (`wandb sync
    <run_dir>/wandb/offline-run-*` uploads them later). Settings keep it light: no console capture,
    no code, git, requirements or job snapshot, no system-metrics sampler (the trainer logs memory
    and MFU itself). Each sink is its own run (`reinit="create_new"`): a run the user opened in
    the same process is neither reused nor finished, and a resumed training run starts a new W&B
    run with the same name (its steps continue from the checkpoint's).
    """

    def __init__(self, run_dir: str | os.PathLike, *, project: str = "posttrain", name: str | None = None,
                 config: dict | None = None):
        wandb = _import_wandb()
        run_dir = os.path.abspath(os.fspath(run_dir))
        os.makedirs(run_dir, exist_ok=True)
        if config is None:  # the trainer lifecycle saves the run's config there before building sinks
            config = _saved_config(run_dir)
        settings = wandb.Settings(console="off", save_code=False, disable_git=True, disable_job_creation=True,
                                  x_save_requirements=False, x_disable_stats=True, x_disable_meta=True,
                                  quiet=True)  # quiet: wandb still says where the run's files went
        try:
            self.run = wandb.init(project=project, name=name or os.path.basename(run_dir), dir=run_dir,
                                  config=config, settings=settings, reinit="create_new")
        except wandb.errors.Error as err:  # e.g. no API key in online mode
            raise PosttrainError(f"metrics.sinks: wandb could not start a run ({err}); log in with `wandb login`, or "
                                 "set WANDB_MODE=offline to write the run locally and `wandb sync` it later") from None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            # Returns once wandb-core has handled the run's exit (offline: milliseconds); the core writes
            # the file's last block when it closes the stream, at the latest when this process exits.
            self.run.finish()
            self.run = None


def _saved_config(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    import yaml

    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def make_sinks(section, run_dir: str | os.PathLike, *, is_main_process: bool = True,
               config: dict | None = None) -> list:
    """Sinks named in `section.sinks` (a MetricsSection). Only process 0 logs: other processes of
    a multi-host run get none, so files are not written N times nor ports bound N times.
    `config` (a plain dict) is the run config a W&B run records; None = `<run_dir>/config.yaml`."""
    if not is_main_process:
        return []
    run_dir = os.fspath(run_dir)
    sinks: list = []
    try:
        _add_sinks(sinks, section, run_dir, config)
    except BaseException:  # e.g. wandb could not start: release the ports and files already opened
        for sink in sinks:
            sink.close()
        raise
    return sinks


def _add_sinks(sinks: list, section, run_dir: str, config: dict | None) -> None:
    for name in section.sinks:
        if name == "jsonl":
            sinks.append(JsonlSink(os.path.join(run_dir, "metrics.jsonl")))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(os.path.join(run_dir, "tensorboard")))
        elif name == "prometheus":
            sinks.append(PrometheusSink(section.prometheus_host, section.prometheus_port))
        elif name == "wandb":
            sinks.append(WandbSink(run_dir, project=section.wandb_project, config=config))
        # "console" is the loop's progress bar: nothing to build here.


# ----------------------------------------------------------------------------- profiler


class Profiler:
    """Traces steps start_step .. start_step+num_steps-1 with `jax.profiler` into `logdir`
    (open with TensorBoard's profile plugin or Perfetto). start_step = 0 turns it off.

    The trace stops only after the window's last step has finished on the device (block on its
    output), otherwise asynchronous dispatch would cut the traced work short.
    """

    def __init__(self, start_step: int, num_steps: int, logdir: str | os.PathLike):
        self.start, self.stop = int(start_step), int(start_step) + int(num_steps) - 1
        self.logdir = os.fspath(logdir)
        self.active = False

    def before_step(self, step: int) -> None:
        if self.start > 0 and step == self.start and not self.active:
            jax.profiler.start_trace(self.logdir)
            self.active = True

    def after_step(self, step: int, sync_value) -> None:
        if self.active and step >= self.stop:
            jax.block_until_ready(sync_value)
            self.close()

    def close(self) -> None:
        """Stop an open trace (training ended inside the window, or an error unwound the loop)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


# ----------------------------------------------------------------------------- FLOPs and MFU


@functools.cache
def measure_peak_flops(n: int = 2048, reps: int = 5, dtype: str | None = None) -> float:
    """Best observed matmul FLOP/s of an n x n jitted matmul on the default device: float32 on a CPU, bfloat16 on
    an accelerator (a TPU's or GPU's matrix units peak in bfloat16, the dtype their MFU is quoted against), or
    `dtype`.

    A stand-in for the datasheet peak (set metrics.peak_flops for that): on CPU there is no
    datasheet figure, and an achieved-matmul peak makes MFU comparable across machines. Cached:
    measured once per process and size.
    """
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if dtype != "float32" and n < 4096:
        n = 8192  # an accelerator needs a large product to reach its peak (v5e: 185 TFLOP/s at 8192^2)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))  # compile and warm up outside the timing
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t0)  # min: least disturbed by other processes
    return 2.0 * n**3 / best


def peak_flops(section) -> float:
    """Per-device peak FLOP/s: `section.peak_flops` when configured, else measured."""
    return float(section.peak_flops) if section.peak_flops is not None else measure_peak_flops()


def mfu(tokens_per_s: float, flops_per_token: float, peak: float, num_devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices used."""
    return tokens_per_s * flops_per_token / (peak * num_devices)


# ----------------------------------------------------------------------------- memory


HIGH_MEMORY = 0.9  # a warning when a device's peak passes this share of its memory


def memory_stats(device=None) -> dict:
    """Live memory of the first local device (GPU/TPU): bytes in use, peak, and the peak's share of the device's
    limit (`device_memory_frac`); or the host process RSS on CPU, where JAX's allocator reports no statistics."""
    try:
        stats = (device or jax.local_devices()[0]).memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and "bytes_in_use" in stats:
        out = {"device_bytes_in_use": int(stats["bytes_in_use"]),
               "device_peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))}
        if stats.get("bytes_limit"):
            out["device_memory_frac"] = out["device_peak_bytes"] / int(stats["bytes_limit"])
        return out
    import psutil

    return {"host_rss_bytes": int(psutil.Process().memory_info().rss)}


class MemoryWarning:
    """Warns once per run when the device's peak memory passes HIGH_MEMORY of its limit (the next larger batch or
    sequence would not fit: remat, micro-batches or LoRA are the remedies). Call with each step's metrics."""

    def __init__(self, threshold: float = HIGH_MEMORY):
        self.threshold, self.warned = threshold, False

    def __call__(self, metrics: dict) -> bool:
        frac = metrics.get("device_memory_frac")
        if self.warned or frac is None or frac <= self.threshold:
            return False
        self.warned = True
        warnings.warn(f"device memory: the peak is {frac:.0%} of the device's limit (above "
                      f"{self.threshold:.0%}); a longer row or a larger batch may not fit. Turn on model.remat, "
                      "set train.micro_batch_size, or train LoRA", stacklevel=2)
        return True
