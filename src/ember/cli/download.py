"""`ember download REPO_ID`: fetch a Hugging Face checkpoint into the standard Hugging Face cache.

Only what Ember reads is fetched (config, safetensors, tokenizer and generation files). Ember reads the
checkpoint from the cache afterwards; it never copies it elsewhere.
"""

from __future__ import annotations

import argparse

from ember.errors import EmberError
from ember.loading.hub import ALIASES

PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "download", help="download a Hugging Face checkpoint into the HF cache", description=__doc__
    )
    p.add_argument("repo_id", help="a repo id such as HuggingFaceTB/SmolLM2-360M-Instruct, or an alias")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument("--token", default=None, help="Hugging Face token for gated repos (default: HF_TOKEN)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    repo_id = ALIASES[args.repo_id].repo_id if args.repo_id in ALIASES else args.repo_id
    try:
        path = snapshot_download(repo_id, revision=args.revision, token=args.token, allow_patterns=PATTERNS)
    except HFValidationError:
        raise EmberError(
            f"{repo_id!r} is not a Hugging Face repo id; expected OWNER/NAME (letters, digits, '-', '_', '.'), "
            "such as HuggingFaceTB/SmolLM2-360M-Instruct, or an alias from `ember list`"
        ) from None
    except RepositoryNotFoundError:
        raise EmberError(
            f"repo {repo_id!r} not found on the Hugging Face Hub (or it is gated: pass --token)"
        ) from None
    except LocalEntryNotFoundError:
        raise EmberError(
            f"cannot download {repo_id!r}: the Hugging Face Hub is unreachable (no network?) "
            "and it is not in the cache"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise EmberError(f"cannot download {repo_id!r}: {e}") from None
    print(path)
    return 0
