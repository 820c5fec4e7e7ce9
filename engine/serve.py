"""`python -m engine.serve --model NAME [options] [key=value ...]`: the OpenAI-compatible HTTP server.

NAME is a conf/model name (dummy weights for shapes, or the weights it names), a local HF
directory, or a .gguf file. Every `EngineArgs` field is an option (`--num-gpu-blocks 512`,
`--policy priority`; a boolean one is a switch taking no value, as vLLM's: `--enforce-eager`,
`--disable-custom-all-reduce`, `--no-async-scheduling`) or a Hydra-style override
(`num_gpu_blocks=512 policy=priority enforce_eager=true`). Server
options: --host (127.0.0.1 by default: loopback only unless asked), --port (1..65535; host and port
are bound once before the engine is built, so a bad address or a busy port fails at once), --served-model-name
(one or more names clients may send as `model`), --chat-template, --max-waiting-requests (past it
new requests get HTTP 503), --api-key (or SERVELAB_API_KEY: bearer keys for /v1/*),
--max-request-body-bytes (413 past it), --[no-]engine-process (the engine in its own process, the
default, or in a thread of the server's). Data parallelism (docs/fleet.md): --data-parallel-size N
replicas, one engine core process each on its own GPU(s), every request routed by --router NAME
(a `policies/routing` router, round_robin by default) with its keys as --router-arg KEY=VALUE,
its snapshots refreshed every --router-refresh-s seconds (0: at each request), the replicas
started by --replica-launcher (local processes, or ray); a replica holding requests that sends
nothing for --replica-timeout-s seconds (default 60) is hung: out of rotation, its requests
failed, its process terminated. --disaggregation prefill=1,decode=1: a
prefill engine and a decode engine on two GPUs, KV blocks moved between them
(docs/disaggregation-engine.md). A bad value is one line `error: ...` and exit code 2.
SIGTERM or Ctrl-C end every open stream with an error event and `data: [DONE]`, then stop.
Examples:

    python -m engine.serve --model qwen3-0.6b
    python -m engine.serve --model smollm2-135m num_gpu_blocks=256 max_model_len=2048   # on CPU
    python -m engine.serve --model qwen3-0.6b --data-parallel-size 2 --router prefix_aware \
        --router-arg balance_abs_threshold=8 block_manager=prefix        # two GPUs, one router
    python -m engine.serve --model qwen3-0.6b --disaggregation prefill=1,decode=1      # cuda:0 + cuda:1
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "qwen3-0.6b", "prompt": [1, 2, 3], "max_tokens": 8}'
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import yaml

from engine.engine_args import EngineArgs
from engine.serving.guards import API_KEY_ENV, BYTES_PER_TOKEN, api_keys_from
from engine.serving.serve_options import LOG_LEVELS, MAX_PORT, check_listen, check_server_options
from engine.serving.server import LOOPBACK

SERVER_OPTIONS = ("host", "port", "served_model_name", "chat_template", "max_waiting_requests", "log_level",
                  "engine_process", "api_key", "max_request_body_bytes", "data_parallel_size", "router", "router_arg",
                  "router_refresh_s", "replica_launcher", "replica_timeout_s", "disaggregation")
# The EngineArgs fields that are on/off switches: on the command line a flag and its --no- form
# (`--disable-custom-all-reduce`, `--no-async-scheduling`), taking no value, as vLLM's.
BOOLEAN_FIELDS = tuple(f.name for f in dataclasses.fields(EngineArgs) if f.type in ("bool", bool))


def parse_value(text: str) -> Any:
    """`512` -> 512, `true` -> True, `null` -> None, `fcfs` -> 'fcfs' (YAML scalars, as Hydra reads them)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="conf/model name, HF directory or .gguf file")
    p.add_argument("--host", default=LOOPBACK, help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help=f"TCP port to listen at, 1..{MAX_PORT} (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the `model` names clients may send; the first is the one reported "
                        "(default: the model's name). E.g. the tokenizer's HF id, for benchmark clients")
    p.add_argument("--chat-template", default=None, help="a Jinja file or string replacing the tokenizer's")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="refuse new requests (HTTP 503) while this many wait (default: no cap)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, "
                        "else no authentication; /health and /metrics stay open)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="refuse larger request bodies with HTTP 413 (default: room for a prompt of "
                        f"max_model_len tokens, {BYTES_PER_TOKEN} bytes each, at least 1 MiB)")
    p.add_argument("--log-level", default="info", help=f"uvicorn's and the server's: one of {', '.join(LOG_LEVELS)}")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, apart from the HTTP front end (default); "
                        "--no-engine-process steps it in a thread of the server's process")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="serve N engine replicas, one core process each on its own GPU(s) (default 1)")
    p.add_argument("--router", default="round_robin", metavar="NAME",
                   help="the router in front of the replicas (policies/routing; default round_robin)")
    p.add_argument("--router-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="one of the router's own keys (repeatable), e.g. balance_abs_threshold=8")
    p.add_argument("--router-refresh-s", type=float, default=0.0, metavar="S",
                   help="refresh the router's replica snapshots every S seconds (default 0: at each request)")
    p.add_argument("--replica-launcher", default="local", metavar="NAME",
                   help="what starts the replicas: local (processes on this machine, default) or ray "
                        "(actors of the Ray cluster RAY_ADDRESS names, or a local one)")
    p.add_argument("--replica-timeout-s", type=float, default=None, metavar="S",
                   help="a replica holding requests that sends no step result for S seconds is hung: it leaves "
                        "the rotation, its requests fail, its process is terminated (default 60)")
    p.add_argument("--disaggregation", default=None, metavar="SPEC",
                   help="prefill/decode disaggregation, e.g. prefill=1,decode=1 (more keys: transfer_timeout_s, "
                        "decode_device, max_queue, queue_timeout_s, prefill_async_scheduling=true|false, sends_mid_step=true|false): "
                        "the prefill engine in a thread of the "
                        "server's process, the decode engine in its own (--engine-process does not apply)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in BOOLEAN_FIELDS:  # switches, as vLLM's: --enforce-eager, --no-async-scheduling
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"EngineArgs.{f.name} (default {f.default!r})")
        elif f.name != "model":
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=parse_value, default=argparse.SUPPRESS,
                           help=f"EngineArgs.{f.name} (default {f.default!r})")
    p.add_argument("overrides", nargs="*", help="EngineArgs overrides as key=value")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `key=value` words after --served-model-name are overrides, not names (a
    model name has no `=`), so `--served-model-name a b num_gpu_blocks=64` reads as meant."""
    ns = build_parser().parse_args(argv)
    if ns.served_model_name:
        names = [n for n in ns.served_model_name if "=" not in n]
        ns.overrides = [*ns.overrides, *(n for n in ns.served_model_name if "=" in n)]
        ns.served_model_name = names or None
    return ns


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {k: v for k, v in vars(ns).items() if k not in (*SERVER_OPTIONS, "overrides")}
    for item in ns.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            hint = (f"; the boolean options ({', '.join('--' + n.replace('_', '-') for n in BOOLEAN_FIELDS)}) are "
                    "switches taking no value (--no-<option> for false)") if isinstance(parse_value(item), bool) else ""
            raise ValueError(f"override {item!r} is invalid: write key=value (an EngineArgs field){hint}")
        values[key.lstrip("+").replace("-", "_")] = parse_value(value)
    return EngineArgs.from_dict(values)


def router_from(ns: argparse.Namespace):
    """The router the command line names, with its keys checked (ValueError naming the key)."""
    from policies.routing import make_router

    cfg: dict[str, Any] = {"name": ns.router}
    for item in ns.router_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--router-arg {item!r} is invalid: write KEY=VALUE (a key of router {ns.router!r})")
        cfg[key.replace("-", "_")] = parse_value(value)
    try:
        return make_router(cfg)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"router.{exc}") from None


def uses_replicas(ns: argparse.Namespace) -> bool:
    """A replica set serves (else one engine, as before data parallelism)."""
    return ns.data_parallel_size != 1 or ns.replica_launcher != "local"


def check_replica_options(ns: argparse.Namespace):
    """The data-parallel options, checked; the router, or None without replicas."""
    from engine.online.replica_launcher import REPLICA_LAUNCHERS, check_data_parallel_size
    from engine.online.replica_set import check_replica_timeout

    check_data_parallel_size(ns.data_parallel_size)
    REPLICA_LAUNCHERS.get(ns.replica_launcher)
    router = router_from(ns)
    if not 0 <= ns.router_refresh_s < float("inf"):
        raise ValueError(f"router_refresh_s={ns.router_refresh_s} is invalid: a finite number >= 0 (0: exact)")
    if ns.replica_timeout_s is not None:
        check_replica_timeout(ns.replica_timeout_s, "--replica-timeout-s")
    if not uses_replicas(ns):
        if ns.replica_timeout_s is not None:
            raise ValueError("--replica-timeout-s is invalid without replicas: it applies to --data-parallel-size > 1 "
                             "or --replica-launcher ray")
        return None
    if not ns.engine_process:
        raise ValueError("--no-engine-process is invalid with --data-parallel-size > 1: each replica is an "
                         "engine core process")
    return router


def build_engine(ns: argparse.Namespace, args: EngineArgs, router):
    from engine.online.async_llm_engine import AsyncLLMEngine
    from engine.online.replica_launcher import launch_replica_set
    from engine.online.replica_set import DEFAULT_TIMEOUT_S

    if ns.disaggregation is not None:
        from engine.disagg.pd_engine import DisaggregatedEngine
        from engine.online.thread_host import ThreadHost

        host = ThreadHost(DisaggregatedEngine(args, ns.disaggregation, keep_trace=False), close_engine=True)
        return AsyncLLMEngine(host, max_waiting_requests=ns.max_waiting_requests)
    if router is None:
        return AsyncLLMEngine.from_engine_args(args, max_waiting_requests=ns.max_waiting_requests,
                                               engine_process=ns.engine_process)
    timeout_s = DEFAULT_TIMEOUT_S if ns.replica_timeout_s is None else ns.replica_timeout_s
    replicas = launch_replica_set(args, ns.data_parallel_size, router, ns.router_refresh_s, ns.replica_launcher,
                                  timeout_s=timeout_s)
    return AsyncLLMEngine(replicas, max_waiting_requests=ns.max_waiting_requests)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    try:
        check_server_options(ns)
        args = engine_args_from(ns)
        args.check()  # shapes, KV sizing, max_model_len: before any weight loads
        api_keys = api_keys_from(None if ns.api_key is None else [ns.api_key])
        router = check_replica_options(ns)
        if ns.disaggregation is not None:
            from engine.disagg.config import DisaggregationConfig

            ns.disaggregation = DisaggregationConfig.parse(ns.disaggregation)
            if router is not None:
                raise ValueError("--disaggregation is invalid with --data-parallel-size or --replica-launcher: the "
                                 "engine pair is one prefill and one decode engine on this machine")
        check_listen(ns.host, ns.port)  # last: the address is free now, the engine is built next
    except ValueError as exc:
        _fail(str(exc))
    from engine.serving.app import build_app
    from engine.serving.server import Server, slow_io_warning, uvicorn_config

    try:
        engine = build_engine(ns, args, router)
        app = build_app(engine, ns.served_model_name, ns.chat_template, api_keys=api_keys,
                        max_request_body_bytes=ns.max_request_body_bytes)
    except ValueError as exc:  # the weights or the tokenizer the arguments name are wrong
        _fail(str(exc))
    if ns.host not in (LOOPBACK, "localhost", "::1"):
        print(f"warning: binding {ns.host}: the server is reachable beyond this machine", file=sys.stderr)
    warning = slow_io_warning()
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    auth = ", API key required" if api_keys else ""
    fleet = f", {ns.data_parallel_size} replicas behind router {ns.router!r}" if router is not None else ""
    print(f"serving {app.state.ctx.model_name!r} at http://{ns.host}:{ns.port}/v1{auth}{fleet}", file=sys.stderr)
    try:
        Server(uvicorn_config(app, ns.host, ns.port, ns.log_level)).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: the shutdown is done, quietly
        sys.exit(130)


if __name__ == "__main__":
    main()
