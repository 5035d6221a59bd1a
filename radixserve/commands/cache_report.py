"""``radixserve cache-report``: a running server's miss report, read over HTTP.

Prints the top divergence positions (where prompts left the longest cached path, with the
decoded tokens around each) and how many misses had each reason. It reads
``GET /cache_report`` (an admin path: ``--api-key`` takes the admin key when the server has
one). Divergence positions count every admitted prompt; reasons count the requests that
asked for a report (``return_cache_report``), or every request on a server started with
``--cache-report``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from radixserve.cli import register


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server's HTTP address (default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help="the admin key (or API key) when the server has keys (env RADIXSERVE_API_KEY)",
    )
    p.add_argument("--top", type=int, default=10, help="divergence positions to show (10)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server")


def fetch(url: str, api_key: str | None, top: int, timeout_s: float) -> dict[str, Any]:
    """``GET {url}/cache_report`` as JSON (never through a proxy: it carries the admin key)."""
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"{url.rstrip('/')}/cache_report?top={top}", headers=headers)
    with opener.open(req, timeout=timeout_s) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def render(report: dict[str, Any]) -> str:
    """The report as text: the top positions with their context, then the reasons."""
    lines = [
        f"prompts: {report.get('prompts', 0)}  explained (reasons): {report['reports']}"
        f"  flushes: {report.get('flushes', 0)} ({report.get('flushed_pages', 0)} pages)"
    ]
    top = report.get("top_divergence") or []
    if top:
        lines.append("top divergence positions (token index, prompts, ...before | after...):")
        for e in top:
            ctx = f"...{e['before']!r} | {e['after']!r}..."
            held = f"  (cached path: {e['cached_after']!r})" if e.get("cached_after") else ""
            lines.append(f"  {e['index']:>7}  {e['count']:>6}  {ctx}{held}")
    else:
        lines.append("no divergence recorded yet")
    reasons = {k: v for k, v in (report.get("reasons") or {}).items() if v}
    if reasons:
        lines.append("miss reasons:")
        for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<16} {v}")
    return "\n".join(lines)


@register(
    "cache-report",
    help="a running server's cache misses: top divergence positions and reasons",
    arguments=_arguments,
)
def cache_report(args: argparse.Namespace) -> int:
    import urllib.error

    try:
        report = fetch(args.url, args.api_key, args.top, args.timeout)
    except urllib.error.HTTPError as exc:
        print(f"cache-report: {args.url} answered {exc.code}: {exc.reason}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"cache-report: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
