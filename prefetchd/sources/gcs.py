"""Google Cloud Storage (``gs://``): where a bucket's credentials and endpoint come from, said
without a secret. ``objectstore.ObjectStore`` makes the client; this module only reads settings.

obstore's ``GCSStore`` (the ``object_store`` crate's builder) reads, first found wins:

* ``dataset.storage_options``, by obstore's names (``service_account``, ``service_account_key``,
  ``application_credentials``, ``base_url``, ``skip_signature``; a ``google_`` prefix is allowed);
* ``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_SERVICE_ACCOUNT_PATH`` (a service account's JSON key file),
  ``GOOGLE_SERVICE_ACCOUNT_KEY`` (that JSON itself); such a file's optional ``gcs_base_url`` (an
  emulator's URL) and ``disable_oauth`` are honoured;
* ``GOOGLE_APPLICATION_CREDENTIALS`` (application default credentials: a service account's key
  file, or ``gcloud auth application-default login``'s user), else gcloud's well-known file
  ``~/.config/gcloud/application_default_credentials.json``;
* else the metadata server: a VM's or a GKE pod's service account;
* ``GOOGLE_BASE_URL``: the endpoint, else ``https://storage.googleapis.com``.

A service account's key signs a token on this host (a self-signed JWT, no token endpoint asked).

Added here, as Google's client libraries and gcsfs do: ``STORAGE_EMULATOR_HOST`` (an emulator's
``host:port`` or URL) is the endpoint when none of the above names one, and requests are not
signed when no credentials are given at all (an emulator checks none).

The private key is never read into a line: ``describe`` names the account by its ``client_email``
and where it was found, and an error naming a credentials file names its path only.
"""

from __future__ import annotations

import errno
import json
import os
import re

GCS_URL = "https://storage.googleapis.com"
_ADC_WELL_KNOWN = os.path.join("~", ".config", "gcloud", "application_default_credentials.json")


def _option(options: dict, name: str):
    """``name`` from ``dataset.storage_options`` as obstore takes it: any case, ``google_`` or not."""
    given = {k.lower(): v for k, v in options.items()}
    for k in (name, "google_" + name):
        if given.get(k) not in (None, ""):
            return given[k]
    return None


def _account(options: dict) -> tuple[str, dict]:
    """(where the credentials come from, in words; the fields of its JSON that may be said:
    ``client_email``, ``type``, ``gcs_base_url``), or ("", {}) where none is given."""
    for name, env, inline in (("service_account_key", "GOOGLE_SERVICE_ACCOUNT_KEY", True),
                              ("service_account", "GOOGLE_SERVICE_ACCOUNT", False),
                              ("service_account_path", "GOOGLE_SERVICE_ACCOUNT_PATH", False),
                              ("application_credentials", "GOOGLE_APPLICATION_CREDENTIALS", False)):
        value, where = _option(options, name), f"dataset.storage_options.{name}"
        if value is None and os.environ.get(env):
            value, where = os.environ[env], env
        if value is None:
            continue
        if inline or str(value).lstrip().startswith("{"):  # a key's JSON itself, even where a path is meant
            return f"the key in {where}", _fields(str(value))  # never said: it holds the private key
        return f"{where} {value}", _fields(_read(str(value)))
    well_known = os.path.expanduser(_ADC_WELL_KNOWN)
    if os.path.exists(well_known):
        return f"gcloud's application default credentials {well_known}", _fields(_read(well_known))
    return "", {}


_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH",
              "GOOGLE_APPLICATION_CREDENTIALS")
_READ_TYPES = ("service_account", "authorized_user")  # the credentials JSON types obstore's GCS client reads
_TYPES = {"external_account": "workload identity federation", "impersonated_service_account":
          "gcloud's --impersonate-service-account", "external_account_authorized_user": "workforce identity federation"}


def refusal(options: dict) -> str | None:
    """Why the credentials given cannot be used, said before any request (None: none seen).
    A variable set but empty (``GOOGLE_SERVICE_ACCOUNT=`` in a manifest) is a key file named ''
    to obstore, where users mean it unset; a JSON of a type obstore does not read was said as
    "names a service account's JSON key file, whole"."""
    empty = [v for v in _VARIABLES if v in os.environ and not os.environ[v].strip()]
    if empty:
        what = "a key of no JSON" if empty[0].endswith("_KEY") else "a key file named ''"
        return (f"{empty[0]} is set but empty, which the GCS client reads as {what}: unset it, or set it to a "
                "service account's JSON key file")
    given = [next((w for w in (f"dataset.storage_options.{name}" if _option(options, name) is not None else "",
                                env if os.environ.get(env) else "") if w), "")
             for name, env in (("service_account_key", "GOOGLE_SERVICE_ACCOUNT_KEY"),
                               ("service_account", "GOOGLE_SERVICE_ACCOUNT"),
                               ("service_account_path", "GOOGLE_SERVICE_ACCOUNT_PATH"))]
    key, path = given[0], given[1] or given[2]
    if key and path:  # obstore said "One of service account path or service account key may be provided"
        envs = [w for w in (key, path) if not w.startswith("dataset.")]  # the environment's gives way
        return (f"{key} (a key) and {path} (a key file) both name a service account, and the GCS client takes one: "
                + (f"unset {envs[-1]}" if envs else f"remove {path}"))
    where, fields = _account(options)
    kind = fields.get("type")
    if kind and kind not in _READ_TYPES:
        return (f"{where} holds credentials of type {kind}" + (f" ({_TYPES[kind]})" if kind in _TYPES else "") +
                ", which prefetchd's GCS client (obstore) cannot use: point it at a service account's JSON key "
                "file or gcloud's user credentials (`gcloud auth application-default login`), or unset it to use the "
                "metadata server's account (a VM's, GKE Workload Identity)")
    return None


def user_credentials(options: dict) -> str:
    """Where gcloud's user credentials (``authorized_user``) are given, in words; "" when those in use are not them."""
    where, fields = _account(options)
    return where if fields.get("type") == "authorized_user" else ""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(1 << 20)
    except (OSError, UnicodeDecodeError):
        return ""  # obstore says what is wrong with it, naming the path (``objectstore._words``)


def _fields(text: str) -> dict:
    """The fields of a credentials JSON that may be said or used here: never the private key."""
    try:
        got = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(got, dict):
        return {}
    # each only in its own shape: a key pasted into the wrong field (a shifted or hand-edited file)
    # was said whole in check's line or in the refusal of its "type"
    return {k: got[k] for k, shape in _SHAPES.items() if isinstance(got.get(k), str) and shape.fullmatch(got[k])}


_SHAPES = {"client_email": re.compile(r"[^\s@]{1,128}@[A-Za-z0-9.-]{1,253}"), "type": re.compile(r"[a-z_]{1,64}"),
           "gcs_base_url": re.compile(r"https?://[^\s]{1,256}")}


def _emulator() -> str:
    """``STORAGE_EMULATOR_HOST`` as a URL ("" when unset): ``host:port`` is taken as http."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip().rstrip("/")
    if host and "://" not in host:
        host = "http://" + host
    return host


def endpoint(options: dict) -> str:
    """The endpoint requests go to when it is not Google's own (""): a ``base_url`` option,
    ``GOOGLE_BASE_URL``, the service account file's ``gcs_base_url``, ``STORAGE_EMULATOR_HOST``."""
    given = _option(options, "base_url") or os.environ.get("GOOGLE_BASE_URL")
    if given:
        return str(given).rstrip("/")
    from_file = _account(options)[1].get("gcs_base_url")
    if from_file:
        return from_file.rstrip("/")
    return _emulator()


def client_config(options: dict) -> dict:
    """What obstore's config needs beyond ``options`` and the environment it reads itself:
    ``STORAGE_EMULATOR_HOST``'s endpoint, and no signing where no credentials are given for it."""
    emulator = _emulator()
    if not emulator or _option(options, "base_url") or os.environ.get("GOOGLE_BASE_URL"):
        return {}
    where, fields = _account(options)
    if fields.get("gcs_base_url"):
        return {}  # the service account names its endpoint: obstore uses it
    out = {"base_url": emulator}
    if not where and _option(options, "bearer_token") is None and not os.environ.get("GOOGLE_BEARER_TOKEN"):
        out["skip_signature"] = True
    return out


def describe(options: dict) -> str:
    """Which identity and endpoint requests go to, with no secret (``prefetchd check``)."""
    where, fields = _account(options)
    if str(_option(options, "skip_signature") or os.environ.get("GOOGLE_SKIP_SIGNATURE", "")).lower() in ("true", "1"):
        who = "anonymous (skip_signature: requests not signed)"
    elif where:
        kind = "service account" if fields.get("type", "service_account") == "service_account" else \
            fields.get("type", "").replace("_", " ")
        who = f"{kind} {fields['client_email']} ({where})" if fields.get("client_email") else \
            f"the credentials in {where}"
    elif client_config(options).get("skip_signature"):
        who = "anonymous (STORAGE_EMULATOR_HOST and no credentials)"
    elif _option(options, "bearer_token") or os.environ.get("GOOGLE_BEARER_TOKEN"):
        who = "a bearer token (GOOGLE_BEARER_TOKEN)"
    else:
        who = "no GOOGLE_APPLICATION_CREDENTIALS: the metadata server's service account (a VM's or pod's)"
    return f"{who}, endpoint {endpoint(options) or 'Google Cloud Storage'}"


# what an error's text says of the answer, without the request's URL, the object's key and the time it took
# (``answer``): a bucket named "...bucket...", port 40312 or "in 1.403ms" say nothing of a 403 or a missing bucket
_NOT_THE_ANSWER = re.compile(r"\S+://\S+|location \S*|\bin [\d.]+\S*?s\b")


def answer(text: str) -> str:
    """``text`` without what names the request (see ``_NOT_THE_ANSWER``)."""
    return _NOT_THE_ANSWER.sub("", text)


# obstore's words for a GCS credentials file it cannot use: unreadable, not JSON, a key that is not RSA
_BAD_CREDENTIALS = ("service account file", "Invalid RSA key", "credentials file", "Unable to decode")


def words(e: OSError, text: str, options: dict) -> str | None:
    """What a gs:// bucket's refusal means, in words (``objectstore.words`` for GCS); None where
    it is no credentials' or access's matter."""
    user = user_credentials(options) if "token request" in text else None
    if user:  # they ran `gcloud auth application-default login` already: its token endpoint did not answer
        return f"no token for gcloud's user credentials in {user} ({text}): they get one from Google's OAuth " \
               "endpoint, which must be reachable from this host; at an emulator, set " \
               "dataset.storage_options.skip_signature: true"
    if any(m in text for m in _BAD_CREDENTIALS):
        if "Permission denied" in text:
            return f"its credentials cannot be read ({text}): the key file must be readable by the user the " \
                   f"daemon runs as ({_user()}): chown or chmod it, or give that user a copy"
        return f"its credentials cannot be used ({text}): check GOOGLE_APPLICATION_CREDENTIALS " \
               "(or GOOGLE_SERVICE_ACCOUNT) names a service account's JSON key file, whole"
    if "token request" in text:
        return f"no token for it ({text}): set GOOGLE_APPLICATION_CREDENTIALS to a service account's " \
               "JSON key file, or run `gcloud auth application-default login`"
    status = re.search(r"\b40[13]\b", answer(text))
    if status or e.errno == errno.EACCES:
        return f"access denied ({status.group(0) if status else '403'}): check the credentials and that " \
               "the account may read the bucket (roles/storage.objectViewer)"
    return None


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"
