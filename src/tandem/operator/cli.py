"""`tandem operator`: its arguments and the kopf run. kopf is imported only to run (so
`--help` works without it); the children's default image comes from TANDEM_IMAGE and
TANDEM_IMAGE_PULL_POLICY (`render.image_from_env`), as the chart sets them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the run's imports (kubernetes, kopf) wait until it runs
    import kopf

    from tandem.operator.reconcile import OperatorConfig

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
    from tandem.operator.reconcile import OperatorConfig
    from tandem.operator.render import image_from_env

    image, pull = image_from_env(environ)
    return OperatorConfig(image=image, image_pull_policy=pull,
                          status_interval_s=args.status_interval,
                          autoscale_interval_s=args.autoscale_interval,
                          resync_interval_s=args.resync_interval)


def settings() -> kopf.OperatorSettings:
    """kopf's settings for Tandem: its own finalizer name, few Events, bounded watches."""
    import kopf

    s = kopf.OperatorSettings()
    s.persistence.finalizer = FINALIZER
    s.posting.level = logging.WARNING  # kopf's log lines as Events: problems only (else
    # one per timer tick); the handlers' own Events (Scaled, Removed) are posted regardless
    s.watching.server_timeout = 300  # watches end and restart, as the API server likes
    return s


async def operator(config: OperatorConfig, *, clusterwide: bool, namespaces: Sequence[str],
                   standalone: bool = True, liveness: str | None = None,
                   stop_flag: threading.Event | None = None,
                   ready_flag: threading.Event | None = None) -> None:
    """The operator until `stop_flag` (or SIGINT/SIGTERM in the main thread)."""
    import kopf

    from tandem.operator.main import registry

    await kopf.operator(registry=registry(config), settings=settings(),
                        standalone=standalone, clusterwide=clusterwide,
                        namespaces=list(namespaces), liveness_endpoint=liveness,
                        memo=kopf.Memo(config=config), stop_flag=stop_flag,
                        ready_flag=ready_flag)


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
    asyncio.run(operator(config, clusterwide=args.all_namespaces, namespaces=args.namespace,
                         standalone=args.standalone, liveness=args.liveness))
    return 0

