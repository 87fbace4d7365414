"""Object storage on S3 (AWS's, or another S3 server: MinIO, Ceph, an on-premise one), the one place that says how
the run reaches it.

- The ``s3`` config section (a profile, an endpoint, a region) becomes the environment variables GDAL and boto3 both
  read (:func:`s3_environment`), set in the workflow's process (:func:`configure_s3`) and so inherited by every job
  and rank it starts, under Slurm too (sbatch and srun pass the submitting environment on). Nothing is put on a
  command line, and credentials are never config keys: they come from the usual places, the environment
  (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), a profile of the AWS credentials file,
  or an instance's role.
- Rasters are read where they live, window by window, through GDAL's ``/vsis3/`` (:mod:`rasterscale.raster.remote`).
  Other files in a bucket (annotations, a model file, STAC items and collections) are read whole: fetched with
  boto3 (:func:`read_object`), or kept as local copies under :data:`COPIES` (:func:`local_copy`), fetched again only
  when the object's ETag changed (a conditional GET), so that Snakemake sees a local file whose time stamp changes
  when the object does.

An object that cannot be fetched is one line naming its URL and S3's reason (``AccessDenied``, ``NoSuchBucket``,
``NoSuchKey``, ``InvalidAccessKeyId``, ...) and where credentials come from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rasterscale.atomic import atomic_path
from rasterscale.errors import InputError

SCHEME = "s3://"
COPIES = ".snakemake/rasterscale/objects"  # local copies of the objects read whole, by bucket and key
CREDENTIALS_HINT = (
    "check the URL and the AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or s3.profile, "
    "~/.aws/credentials; AWS_NO_SIGN_REQUEST=YES for a public bucket; s3.endpoint for another S3 server)"
)


def is_s3(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def s3_environment(section: Mapping[str, Any]) -> dict[str, str]:
    """The environment variables of the ``s3`` section's keys, for GDAL and boto3 alike:

    - ``profile``: ``AWS_PROFILE``;
    - ``endpoint`` (``https://host:port`` of another S3 server): GDAL's ``AWS_S3_ENDPOINT`` (host and port),
      ``AWS_HTTPS`` (from the scheme) and ``AWS_VIRTUAL_HOSTING=FALSE`` (path-style addressing, what MinIO and
      Ceph serve), boto3's ``AWS_ENDPOINT_URL_S3``;
    - ``region``: ``AWS_REGION`` (GDAL's) and ``AWS_DEFAULT_REGION`` (boto3's)."""
    env: dict[str, str] = {}
    if section.get("profile"):
        env["AWS_PROFILE"] = str(section["profile"])
    if section.get("endpoint"):
        url = urlsplit(str(section["endpoint"]))
        env.update(
            AWS_S3_ENDPOINT=url.netloc,
            AWS_HTTPS="YES" if url.scheme == "https" else "NO",
            AWS_VIRTUAL_HOSTING="FALSE",
            AWS_ENDPOINT_URL_S3=f"{url.scheme}://{url.netloc}",
        )
    if section.get("region"):
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = str(section["region"])
    return env


def configure_s3(section: Mapping[str, Any]) -> None:
    """Set the ``s3`` section's environment in this process (the config's keys win over the environment's), and
    point GDAL at the credentials file boto3 reads (``AWS_SHARED_CREDENTIALS_FILE``; GDAL's own name for it is
    ``CPL_AWS_CREDENTIALS_FILE``) where only boto3's is set: both then read the same credentials."""
    os.environ.update(s3_environment(section))
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE")
    if shared and "CPL_AWS_CREDENTIALS_FILE" not in os.environ:
        os.environ["CPL_AWS_CREDENTIALS_FILE"] = shared


def is_local_copy(path: str) -> bool:
    """Whether ``path`` is a local copy of an object (:func:`local_copy`): what tells its versions apart is the
    object's ETag in its bucket, which no stat of the copy watches."""
    return path.startswith(f"{COPIES}/")


def bucket_and_key(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b.gpkg`` as ``("bucket", "a/b.gpkg")``; one line naming it when either is missing."""
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise InputError(f"{url}: not an S3 object's URL (s3://bucket/key)")
    return bucket, key


def _client() -> Any:
    """A boto3 S3 client from the environment (credentials, profile, endpoint, region), path-style where GDAL is
    told so (``AWS_VIRTUAL_HOSTING=FALSE``)."""
    import boto3
    from botocore.config import Config

    path_style = os.environ.get("AWS_VIRTUAL_HOSTING", "").upper() in ("FALSE", "NO", "0", "OFF")
    unsigned = os.environ.get("AWS_NO_SIGN_REQUEST", "").upper() in ("YES", "TRUE", "1", "ON")
    config = Config(
        s3={"addressing_style": "path"} if path_style else {},
        retries={"max_attempts": 4, "mode": "standard"},  # a throttled or failed request is retried, as GDAL's
        **({"signature_version": _unsigned()} if unsigned else {}),
    )
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return boto3.session.Session().client("s3", region_name=region, config=config)


def _unsigned() -> Any:
    from botocore import UNSIGNED

    return UNSIGNED


def _fetch_error(url: str, err: Exception) -> InputError:
    """The one line of an object that cannot be fetched: its URL, S3's code and message (or boto3's reason)."""
    response = getattr(err, "response", None)
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        reason = f"{error.get('Code', '?')}: {error.get('Message') or 'no message'}"
    else:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return InputError(f"{url}: cannot be fetched from S3 ({reason}); {CREDENTIALS_HINT}")


def read_object(url: str) -> bytes:
    """An S3 object's bytes (a STAC item or collection)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = bucket_and_key(url)
    try:
        return bytes(_client().get_object(Bucket=bucket, Key=key)["Body"].read())
    except (BotoCoreError, ClientError) as err:
        raise _fetch_error(url, err) from err


def local_copy(url: str, folder: str | Path = COPIES, missing_ok: bool = False) -> str | None:
    """The path of a local copy of an S3 object, ``{folder}/{bucket}/{key}``, fetched when there is none or the
    object's ETag is not the copy's (a conditional GET: an unchanged object is not fetched again), written
    atomically (a partial fetch leaves no copy). ``missing_ok``: None when there is no such key (and no copy)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = bucket_and_key(url)
    path = Path(folder) / bucket / key
    tag_file = path.with_name(path.name + ".etag")
    known = tag_file.read_text() if path.exists() and tag_file.exists() else None
    try:
        response = _client().get_object(Bucket=bucket, Key=key, **({"IfNoneMatch": known} if known else {}))
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code")
        if known and code in ("304", "NotModified"):
            return str(path)
        if missing_ok and code in ("NoSuchKey", "404"):
            path.unlink(missing_ok=True)
            return None
        raise _fetch_error(url, err) from err
    except BotoCoreError as err:
        raise _fetch_error(url, err) from err
    try:
        with atomic_path(path) as partial, open(partial, "wb") as out:
            for chunk in response["Body"].iter_chunks(2**20):
                out.write(chunk)
    except (BotoCoreError, ClientError) as err:
        raise _fetch_error(url, err) from err
    tag_file.write_text(response.get("ETag", ""))
    return str(path)
