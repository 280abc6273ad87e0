"""`tandem render -f FILE`: every object the operator would apply for an InferenceService,
as multi-document YAML in apply order, without a cluster.

Built on the operator's own code path, not a copy: the document is first judged as the API
server judges it (`crd_schema.check`: strict field validation against the CRD's own schema,
defaults applied), then `parse_spec` (with the CRD's CEL rules repeated), `cli.config_from`
on the environment the chart gives its operator (`chart_defaults`: the default install
`helm install tandem charts/tandem -n tandem-system`, or `--values`, `--release`,
`--set`, `--operator-namespace` for another; TANDEM_* variables and the image flags override it) and
the admission the operator runs before it applies (`reconcile.check_environment`: what the
installation has, e.g. Redis for `router.managedRedis`, and the chart's `security.*` policy)
and `reconcile.apply` itself, run against a `Recorder` instead of a cluster: the output is its
writes, in order. A Secret it creates once with random key material (the worker-auth key) is
printed with a placeholder value. What only a live cluster knows comes from flags: the
namespace (else the document's, else "default"), the InferenceService's uid (else the
document's, else a placeholder the output says is one) and the replicas the operator's
autoscaler chose.

A manifest `kubectl apply` would refuse exits 1 (as kubectl does), the reason on stderr:
what the API server refuses, in kubectl's words (an unknown field named by its path, a value
the schema does not allow), a spec the operator refuses (its `InvalidSpec` condition's message,
which names the field: `parse_spec`'s checks, then the installation's admission), unreadable
YAML or file, a document that is not an InferenceService (`kind: List` is expanded), a
metadata.namespace other than `--namespace` or that is no namespace name. A command line it
cannot use exits 2, as argparse's errors do: `--replicas` of a pool the operator does not
scale, `--uid` for several documents, a `--namespace` that is no namespace name, an
unreadable `--values` file, a `--set` it cannot parse, or values the chart's
values.schema.json refuses (as helm refuses them: an unknown key such as `redis.enable`, a
value of the wrong type or range). A file of several InferenceServices renders each, one
after the other.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import yaml

from tandem.operator import chart_defaults
from tandem.operator.crd_schema import Invalid, check
from tandem.operator.render.common import (
    API_VERSION,
    IMAGE_ENV,
    KIND,
    PULL_POLICY_ENV,
    ROUTER_IMAGE_ENV,
    WORKER_CUDA_IMAGE_ENV,
    WORKER_IMAGE_ENV,
    Owner,
)
from tandem.operator.render.security import OPERATOR_NAMESPACE_ENV, OPERATOR_RELEASE_ENV
from tandem.operator.spec import InferenceServiceSpec, SpecError, check_name, parse_spec

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
PLACEHOLDER_VALUE = "<generated-by-the-operator>"  # not base64 on purpose: never a key


class RenderError(Exception):
    """A manifest `tandem render` refuses, as `kubectl apply` would refuse it (exit 1)."""

    exit_code = 1


class UsageError(RenderError):
    """A command line `tandem render` refuses (exit 2, as argparse's errors)."""

    exit_code = 2


@dataclass(frozen=True)
class Service:
    """One InferenceService document, parsed."""

    owner: Owner
    spec: InferenceServiceSpec
    placeholder_uid: bool


class _PlainDumper(yaml.SafeDumper):
    """Every object written out in full: no `&id` anchors and `*id` aliases where render
    functions share one dict between places (a reviewer reads each place on its own)."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def add_render_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, metavar="FILE",
                   help="the InferenceService manifest(s); - reads stdin")
    p.add_argument("-n", "--namespace", default=None,
                   help="the namespace the InferenceService is applied to (default: the "
                        "document's metadata.namespace, else 'default')")
    p.add_argument("--uid", default=None, help="the InferenceService's metadata.uid, which "
                   "the children's ownerReferences name (default: the document's, else a "
                   "placeholder)")
    chart = p.add_argument_group(
        "the operator's installation (default: the chart's, as `helm install tandem "
        "charts/tandem -n tandem-system` installs it)")
    chart.add_argument("--values", action="append", default=[], metavar="FILE",
                       help="a values file given to `helm install -f` (repeatable, merged in "
                            "order over the chart's defaults): its images, pull secrets, "
                            "Redis, security policy and operator.env, as the chart gives "
                            "them to the operator")
    chart.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       dest="set_values",
                       help="a value as `helm install --set` gives it (repeatable, after "
                            "--values): dotted keys, true/false/null, whole numbers, "
                            "{a,b} lists, commas between several; e.g. redis.enabled=true, "
                            "security.allowedRegistries={registry.example.com}")
    chart.add_argument("--release", default=None, metavar="NAME",
                       help="the chart's release name (default: $TANDEM_OPERATOR_RELEASE, "
                            f"else {chart_defaults.RELEASE!r}): the routers' "
                            "tandem.dev/operator-release label and the NetworkPolicies' "
                            "operator peer; '' for an operator the chart did not install")
    chart.add_argument("--operator-namespace", default=None, metavar="NS",
                       help="the chart's namespace (default: $TANDEM_OPERATOR_NAMESPACE, "
                            f"else {chart_defaults.NAMESPACE!r})")
    chart.add_argument("--image", default=None,
                       help="one image for every child (default: $TANDEM_IMAGE, else the "
                            "chart's images: the CPU, CUDA and control images): replaces "
                            "them all but those named by the three flags below")
    chart.add_argument("--image-pull-policy", default=None,
                       choices=("Always", "IfNotPresent", "Never"),
                       help="default: $TANDEM_IMAGE_PULL_POLICY, else the chart's "
                            "image.pullPolicy")
    chart.add_argument("--router-image", default=None,
                       help="the routers' image (default: $TANDEM_ROUTER_IMAGE, else the "
                            "chart's control image)")
    chart.add_argument("--worker-image", default=None,
                       help="the CPU pools' image (default: $TANDEM_WORKER_IMAGE, else the "
                            "chart's worker image)")
    chart.add_argument("--worker-cuda-image", default=None,
                       help="the image of pools that request nvidia.com/gpu (default: "
                            "$TANDEM_WORKER_CUDA_IMAGE, else the chart's CUDA worker image)")
    p.add_argument("--replicas", action="append", default=[], metavar="POOL=N",
                   help="the live replicas of a pool the operator's autoscaler drives "
                        "(worker, prefill or decode; repeatable)")
    # what `config_from` reads besides the environment (timers do not change the objects)
    p.set_defaults(status_interval=10.0, autoscale_interval=15.0, resync_interval=300.0)


def load(text: str) -> list[dict[str, Any]]:
    """The InferenceService documents of `text` (empty documents skipped)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"not valid YAML: {exc}") from None
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs, 1):
        items = doc.get("items") if isinstance(doc, dict) and doc.get("kind") == "List" else [doc]
        if items is not None and not isinstance(items, list):
            raise RenderError(f"document {i}: a List's items must be a list, got "
                              f"{type(items).__name__}")
        for item in items or []:
            if not isinstance(item, dict):
                raise RenderError(f"document {i}: a mapping is expected, got "
                                  f"{type(item).__name__}")
            kind, api = item.get("kind"), item.get("apiVersion")
            if (api, kind) != (API_VERSION, KIND):
                raise RenderError(f"document {i}: {api}/{kind} is not an InferenceService "
                                  f"(apiVersion {API_VERSION}, kind {KIND})")
            out.append(item)
    if not out:
        raise RenderError("no InferenceService in the input")
    return out


def invalid_spec(name: str, exc: SpecError) -> RenderError:
    """The operator's refusal: its InvalidSpec condition (and Event) message is `str(exc)`."""
    return RenderError(f'InferenceService "{name}": InvalidSpec: {exc}')


def parse(doc: dict[str, Any], namespace: str | None, uid: str | None) -> Service:
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise RenderError("metadata.name is required")
    name = meta["name"]
    stored = check(doc)  # crd_schema.Invalid: what the API server refuses
    try:
        check_name(name)
        spec = parse_spec(stored.get("spec"))
        check_name(name, spec)
    except SpecError as exc:
        raise invalid_spec(name, exc) from None
    own_ns = meta.get("namespace")
    if own_ns and not _NAMESPACE.fullmatch(own_ns):
        raise RenderError(f"InferenceService {name}: metadata.namespace {own_ns!r} is not a "
                          "namespace name (a DNS-1123 label)")
    if namespace and own_ns and namespace != own_ns:
        raise RenderError(f"InferenceService {name}: metadata.namespace {own_ns!r} does not "
                          f"match --namespace {namespace!r}")
    uid = uid or meta.get("uid")
    return Service(Owner(name, namespace or own_ns or "default", uid or PLACEHOLDER_UID),
                   spec, placeholder_uid=uid is None)


def replica_overrides(flags: list[str], spec: InferenceServiceSpec) -> dict[str, int]:
    """`--replicas POOL=N`, for pools the operator's autoscaler drives (the only counts the
    operator takes from the live Deployment instead of the spec)."""
    from tandem.operator.reconcile import operator_scaled

    scaled = {p.name for p in operator_scaled(spec)}
    out = {}
    for flag in flags:
        pool, _, count = flag.partition("=")
        if not (count.isascii() and count.isdigit()):  # int() refuses "²", isdigit() not
            raise UsageError(f"--replicas {flag!r}: POOL=N, N a whole number")
        if pool not in scaled:
            raise UsageError(f"--replicas {flag!r}: pool {pool!r} is not scaled by the "
                              f"operator (autoscaling.mode: operator): {sorted(scaled) or 'none'}")
        out[pool] = int(count)
    return out


def environment(args: argparse.Namespace, environ: Mapping[str, str],
                values: list[str] | None = None) -> dict[str, str]:
    """The operator's environment: the chart's (`chart_defaults.operator_env` of its values,
    each text in `values` merged over them, then `--set`'s, for the release and namespace:
    either empty is an operator the chart did not install, one the NetworkPolicies do not
    name), the variables in `environ` over it, the flags over both. An image given by
    `--image` or TANDEM_IMAGE replaces the chart's four (the children's default is then the
    only one) but where a more specific variable or flag names its own."""
    release = (args.release if args.release is not None
               else environ.get(OPERATOR_RELEASE_ENV, chart_defaults.RELEASE))
    namespace = (args.operator_namespace if args.operator_namespace is not None
                 else environ.get(OPERATOR_NAMESPACE_ENV, chart_defaults.NAMESPACE))
    try:
        chart = chart_defaults.operator_env(
            chart_defaults.load_values(values or [], getattr(args, "set_values", [])),
            release, namespace)
    except chart_defaults.ValuesError as exc:
        raise UsageError(f"the chart's values (--values, --set): {exc}") from None
    if args.image or environ.get(IMAGE_ENV):
        for env in (ROUTER_IMAGE_ENV, WORKER_IMAGE_ENV, WORKER_CUDA_IMAGE_ENV):
            chart.pop(env, None)
    out = {**chart, **environ, OPERATOR_RELEASE_ENV: release,
           OPERATOR_NAMESPACE_ENV: namespace}
    for env, value in ((IMAGE_ENV, args.image), (PULL_POLICY_ENV, args.image_pull_policy),
                       (ROUTER_IMAGE_ENV, args.router_image),
                       (WORKER_IMAGE_ENV, args.worker_image),
                       (WORKER_CUDA_IMAGE_ENV, args.worker_cuda_image)):
        if value:
            out[env] = value
    return out


class Recorder:
    """A `kube.Kube` with no cluster behind it, for `reconcile.apply` to run against: no
    children yet (but the `live` Deployments' replicas), every write recorded in order."""

    def __init__(self, live: list[dict[str, Any]]) -> None:
        self.live, self.writes = live, []

    def list_owned(self, kind: str, namespace: str, owner: str, uid: str) -> list[dict]:
        return [d for d in self.live if d["kind"] == kind]

    def apply(self, doc: dict[str, Any], manager: str = "") -> dict[str, Any]:
        self.writes.append(("apply", doc))
        return doc

    def create(self, doc: dict[str, Any]) -> bool:
        self.writes.append(("create", doc))
        return True

    def patch(self, kind: str, namespace: str, name: str, body: dict, manager: str = "") -> dict:
        raise AssertionError(f"a patch of {kind}/{name} while rendering")  # autoscaler only

    def delete(self, kind: str, namespace: str, name: str) -> None:
        raise AssertionError(f"a delete of {kind}/{name} while rendering")  # none live


def placeholder(doc: dict[str, Any]) -> dict[str, Any]:
    """A created-once Secret (random key material) with its values replaced."""
    if doc["kind"] != "Secret":
        return doc
    return {**doc, "data": dict.fromkeys(doc.get("data") or {}, PLACEHOLDER_VALUE)}


def writes(svc: Service, config: Any, replicas: dict[str, int],
           members: list[tuple[str, Any]] | None = None) -> list[tuple[str, dict]]:
    """What `reconcile.apply` writes for `svc`, in order, on a cluster without its children
    (operator-scaled pools at `replicas`, as their live Deployments would be); `members`:
    the input's InferenceServices attached to it (`router.attachTo`)."""
    from tandem.operator.reconcile import apply
    from tandem.operator.render import pool_workloads

    live = [{"apiVersion": w.api_version, "kind": w.kind,
             "metadata": {"name": w.name, "namespace": svc.owner.namespace},
             "spec": {"replicas": replicas[w.pool.name]}}
            for w in pool_workloads(svc.spec, svc.owner) if w.pool.name in replicas]
    recorder = Recorder(live)
    apply(recorder, svc.spec, svc.owner, config, members or ())  # type: ignore[arg-type]
    return recorder.writes


def dry_redis(config: Any) -> Any:
    """The config with its Redis (if any) never contacted: `router.managedRedis` gets its URL
    Secret printed (a placeholder value, as every created Secret) and no ACL call."""
    import dataclasses

    from tandem.operator.redis_acl import RedisAcl

    class DryAcl(RedisAcl):
        def ensure_user(self, owner: Owner) -> None:
            pass

    if config.redis is None:
        return config
    return dataclasses.replace(config, redis=DryAcl(dataclasses.replace(
        config.redis.redis, password_file=os.devnull)))


def admit(svc: Service, config: Any) -> None:
    """The operator's checks of `svc` against its installation before it applies
    (`reconcile.check_environment`); its refusal as `invalid_spec`."""
    from tandem.operator.reconcile import check_environment

    try:
        check_environment(svc.spec, svc.owner, config)
    except SpecError as exc:
        raise invalid_spec(svc.owner.name, exc) from None


def render(args: argparse.Namespace, text: str, environ: Mapping[str, str],
           values: list[str] | None = None) -> str:
    """The YAML `tandem render` prints for the manifest(s) in `text`, for the chart
    installed with the values files' texts `values` (`environment`)."""
    from tandem.operator.cli import config_from

    if args.namespace and not _NAMESPACE.fullmatch(args.namespace):
        raise UsageError(f"--namespace {args.namespace!r} is not a namespace name (a "
                         "DNS-1123 label)")
    docs = load(text)
    if args.uid and len(docs) > 1:
        raise UsageError("--uid names one InferenceService; the input holds "
                          f"{len(docs)}")
    env = environment(args, environ, values)
    try:
        config = config_from(args, env)
    except SystemExit as exc:  # the operator would not start: a bad TANDEM_* variable
        raise UsageError(str(exc.code).removeprefix("tandem operator: ")) from None
    dry = dry_redis(config)
    out = []
    services = [parse(doc, args.namespace, args.uid) for doc in docs]
    for svc in services:
        admit(svc, config)
        members = [(m.owner.name, m.spec) for m in services
                   if m.spec.router.attach_to == svc.owner.name
                   and m.owner.namespace == svc.owner.namespace]
        done = writes(svc, dry, replica_overrides(args.replicas, svc.spec), members)
        head = [f"# InferenceService {svc.owner.namespace}/{svc.owner.name}: the "
                f"{len(done)} objects the operator writes, in order"]
        if svc.placeholder_uid:
            head.append(f"# ownerReferences[].uid is a placeholder ({PLACEHOLDER_UID}):\n"
                        "# pass --uid with the InferenceService's metadata.uid before applying")
        if any(verb == "create" for verb, _ in done):
            created = ", ".join(f"{d['kind']}/{d['metadata']['name']}"
                                for verb, d in done if verb == "create")
            head += [f"# {created}: created once by the operator with fresh random key "
                     "material,", f"# never overwritten; printed with the value "
                     f"{PLACEHOLDER_VALUE}, not a key", "# (not base64: the API server "
                     "refuses it, so it cannot be applied by mistake)"]
        out.append("\n".join(head) + "\n")
        out += [yaml.dump(placeholder(d) if verb == "create" else d, Dumper=_PlainDumper,
                          sort_keys=False)
                for verb, d in done]
    return "---\n".join(out)


def run(args: argparse.Namespace, stdin: TextIO | None = None,
        stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    logging.getLogger("tandem.operator").setLevel(logging.WARNING)  # no "created ..." lines
    where = "stdin" if args.filename == "-" else args.filename
    values = []
    for path in args.values:
        try:
            with open(path, encoding="utf-8") as f:
                values.append(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            print(f"tandem render: cannot read --values {path}: {exc}", file=sys.stderr)
            return 2
    try:
        if args.filename == "-":
            text = stdin.read()
        else:
            with open(args.filename, encoding="utf-8") as f:
                text = f.read()
        result = render(args, text, os.environ, values)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"tandem render: cannot read {where}: {exc}", file=sys.stderr)
        return 1
    except RenderError as exc:
        print(f"tandem render: {where}: {exc}", file=sys.stderr)
        return exc.exit_code
    except Invalid as exc:  # the API server's refusal, in kubectl's words
        print(f"tandem render: {where}: {exc}", file=sys.stderr)
        return 1
    stdout.write(result)
    return 0
