"""``python -m shardkit``: tools that run outside training.

    python -m shardkit timeline <folder>     merge a SHARDKIT_TRACE=<folder> run into one Perfetto file
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    timeline = commands.add_parser("timeline", help="merge per-rank traces into one Perfetto/Chrome timeline")
    timeline.add_argument("folder", help="the folder a SHARDKIT_TRACE=<folder> run wrote rank<r>.json files into")
    timeline.add_argument("-o", "--out", default=None, help="output file (default: <folder>/timeline.json)")
    args = parser.parse_args(argv)
    if args.command == "timeline":
        from shardkit.comm import timeline as tl

        path = tl.merge(args.folder, args.out)
        print(f"wrote {path}: open it at https://ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
