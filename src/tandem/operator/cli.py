"""`tandem operator`: its arguments and the kopf run. kopf is imported only to run (so
`--help` works without it); the children's default image comes from TANDEM_IMAGE and
TANDEM_IMAGE_PULL_POLICY (`render.image_from_env`), the routers', CPU pools' and GPU pools'
from TANDEM_ROUTER_IMAGE, TANDEM_WORKER_IMAGE and TANDEM_WORKER_CUDA_IMAGE, as the chart
sets them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import signal
import socket
import threading
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run's imports (kubernetes, kopf) wait until it runs
    import kopf

    from tandem.operator.leader import LeaseConfig
    from tandem.operator.reconcile import OperatorConfig
    from tandem.operator.redis_acl import RedisAcl

logger = logging.getLogger(__name__)
FINALIZER = "tandem.dev/operator"


def add_operator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--standalone", action="store_true",
                   help="no peering with other operators (run one replica)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="handle InferenceServices in every namespace")
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="handle InferenceServices in NS (repeatable; globs as in kopf)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--status-interval", type=_seconds, default=10.0, metavar="S",
                   help="seconds between status refreshes from the Deployments (default 10)")
    p.add_argument("--autoscale-interval", type=_seconds, default=15.0, metavar="S",
                   help="seconds between autoscaler ticks (autoscaling.mode: operator; "
                        "default 15)")
    p.add_argument("--resync-interval", type=_seconds, default=300.0, metavar="S",
                   help="seconds between full re-applies of each InferenceService's children, "
                        "which repair ones deleted or edited by hand (default 300)")
    le = p.add_argument_group("leader election (several replicas, one active)")
    le.add_argument("--leader-elect", action="store_true",
                    help="run the handlers only while holding a coordination.k8s.io Lease; "
                         "the other replicas stand by and take over when it expires")
    le.add_argument("--lease-name", default="tandem-operator", metavar="NAME")
    le.add_argument("--lease-namespace", default=None, metavar="NS",
                    help="default: $TANDEM_OPERATOR_NAMESPACE (the chart sets it)")
    le.add_argument("--lease-duration", type=int, default=15, metavar="S",
                    help="whole seconds a silent lease stays taken (default 15)")
    le.add_argument("--renew-deadline", type=_seconds, default=10.0, metavar="S",
                    help="the leader stops when it could not renew for this long (default 10)")
    le.add_argument("--retry-period", type=_seconds, default=2.0, metavar="S",
                    help="seconds between renewals and standbys' attempts (default 2)")


def _seconds(text: str) -> float:
    """A timer interval: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> OperatorConfig:
    from tandem.operator.admission import policy_from_env
    from tandem.operator.reconcile import OperatorConfig
    from tandem.operator.render import image_from_env
    from tandem.operator.render.common import router_image_from_env, worker_images_from_env
    from tandem.operator.render.pod import PULL_SECRETS_ENV, pull_secrets_from_env
    from tandem.operator.render.security import operator_from_env

    image, pull = image_from_env(environ)
    worker, cuda = worker_images_from_env(environ)
    return OperatorConfig(image=image, image_pull_policy=pull,
                          router_image=router_image_from_env(environ),
                          worker_image=worker, worker_cuda_image=cuda,
                          image_pull_secrets=pull_secrets_from_env(environ.get(PULL_SECRETS_ENV)),
                          status_interval_s=args.status_interval,
                          autoscale_interval_s=args.autoscale_interval,
                          resync_interval_s=args.resync_interval,
                          operator=operator_from_env(environ),
                          redis=redis_acl_from_env(environ),
                          admission=policy_from_env(environ))


def redis_acl_from_env(environ: Mapping[str, str]) -> RedisAcl | None:
    """The chart's Redis (`TANDEM_REDIS_ADDRESS`, `TANDEM_REDIS_ADMIN_PASSWORD_FILE`)."""
    from tandem.operator.redis_acl import RedisAcl, managed_redis_from_env

    try:
        managed = managed_redis_from_env(environ)
    except ValueError as exc:
        raise SystemExit(f"tandem operator: {exc}") from None
    return None if managed is None else RedisAcl(managed)


def lease_from(args: argparse.Namespace, environ: Mapping[str, str]) -> LeaseConfig | None:
    """The Lease of `--leader-elect` (None without it); this replica's identity is its pod
    (host) name and a random suffix, so a restarted pod is a new candidate."""
    if not args.leader_elect:
        return None
    from tandem.operator.leader import LeaseConfig

    namespace = args.lease_namespace or environ.get("TANDEM_OPERATOR_NAMESPACE")
    if not namespace:
        raise SystemExit("tandem operator: --leader-elect needs --lease-namespace or "
                         "TANDEM_OPERATOR_NAMESPACE")
    try:
        return LeaseConfig(args.lease_name, namespace,
                           f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
                           args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as exc:
        raise SystemExit(f"tandem operator: {exc}") from None


def settings() -> kopf.OperatorSettings:
    """kopf's settings for Tandem: its own finalizer name, few Events, bounded watches."""
    import kopf

    s = kopf.OperatorSettings()
    s.persistence.finalizer = FINALIZER
    s.posting.level = logging.WARNING  # kopf's log lines as Events: problems only (else
    # one per timer tick); the handlers' own Events (Scaled, Removed) are posted regardless
    s.watching.server_timeout = 300  # watches end and restart, as the API server likes
    # a deleted InferenceService keeps kopf's finalizer until its timers have stopped; a timer
    # whose (threaded) tick is in flight then is re-checked after this many seconds (kopf's
    # default, 60, kept it up a minute after any delete that landed mid-tick)
    s.background.cancellation_polling = 0.5
    return s


async def operator(config: OperatorConfig, *, clusterwide: bool, namespaces: Sequence[str],
                   standalone: bool = True, liveness: str | None = None,
                   stop_flag: threading.Event | None = None,
                   ready_flag: threading.Event | None = None,
                   lease: LeaseConfig | None = None) -> bool:
    """The operator until `stop_flag` (or SIGINT/SIGTERM in the main thread). With `lease`:
    kopf runs only while this replica leads (`leader.lead`), its writes fenced by the lease;
    False when the lease was lost (the process should exit non-zero and restart)."""
    import kopf

    from tandem.operator.main import registry

    def run(cfg: OperatorConfig, stop: threading.Event | None,
            live: str | None) -> Coroutine[Any, Any, None]:
        return kopf.operator(registry=registry(cfg), settings=settings(),
                             standalone=standalone, clusterwide=clusterwide,
                             namespaces=list(namespaces), liveness_endpoint=live,
                             memo=kopf.Memo(config=cfg), stop_flag=stop, ready_flag=ready_flag)

    if lease is None:
        await run(config, stop_flag, liveness)
        return True
    from kubernetes.client import ApiClient

    from tandem.operator.kube import load_config
    from tandem.operator.leader import Elector, KubeLease, lead

    elector = Elector(KubeLease(ApiClient(load_config()), lease))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    if stop_flag is not None:
        async def watch(flag: threading.Event) -> None:
            while not flag.is_set():
                await asyncio.sleep(0.05)
            stop.set()

        watcher = loop.create_task(watch(stop_flag))  # noqa: F841 - cancelled at the loop's end
    fenced = dataclasses.replace(config, fence=elector.fence)

    async def work(flag: threading.Event) -> None:
        # kopf on an event loop of its own: it takes every task of its loop for its own (and
        # cancels them on exit), and its signal handlers would replace these
        await asyncio.to_thread(lambda: asyncio.run(run(fenced, flag, None)))

    return await lead(elector, work, stop, liveness)


def run(args: argparse.Namespace) -> int:
    if not args.all_namespaces and not args.namespace:
        raise SystemExit("tandem operator: give --all-namespaces or --namespace NS")
    try:
        import kopf  # noqa: F401
    except ImportError:
        raise SystemExit("tandem operator needs kopf: pip install 'tandem[operator]'") from None
    config = config_from(args, os.environ)
    logger.info("operator: children's image %s (pull policy %s), %s", config.image,
                config.image_pull_policy or "default",
                "all namespaces" if args.all_namespaces else ", ".join(args.namespace))
    logger.info("operator: CPU pools run %s, GPU pools %s", config.worker_image or config.image,
                config.worker_cuda_image or config.image)
    if config.worker_cuda_image is None:
        logger.warning("operator: TANDEM_WORKER_CUDA_IMAGE is unset: GPU pools without an "
                       "image of their own run %s, which must be a CUDA build (the "
                       "Dockerfile's worker-cuda target) or their workers exit", config.image)
    lease = lease_from(args, os.environ)
    kept = asyncio.run(operator(config, clusterwide=args.all_namespaces,
                                namespaces=args.namespace, standalone=args.standalone,
                                liveness=args.liveness, lease=lease))
    if not kept:
        logger.error("operator: leadership lost; exiting so the pod restarts as a standby")
    return 0 if kept else 1

