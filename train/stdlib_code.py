"""Code requests built from the Python standard library's docstrings: the ``stdlib-code`` training source.

Each request asks for a function (or method) of a documented standard-library API, described by its signature and
the first paragraph of its docstring; the answers are written by the target (``data.regenerate=true``). A cheap,
license-free code domain that never overlaps the evaluation sets (HumanEval asks for other functions).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

from eagle.records import Message

STDLIB_MODULES = (
    "textwrap", "itertools", "functools", "statistics", "string", "json", "collections", "heapq", "bisect",
    "fractions", "math", "cmath", "os.path", "re", "shutil", "datetime", "difflib", "operator", "random", "base64",
    "binascii", "calendar", "colorsys", "html", "urllib.parse", "fnmatch", "glob", "ipaddress", "secrets",
    "hashlib", "zlib", "struct", "copy", "pprint", "enum", "decimal", "dataclasses", "contextlib", "csv",
    "tempfile", "filecmp", "uuid", "unicodedata", "quopri", "shlex", "tarfile", "gzip", "fileinput", "queue",
    "typing", "locale", "keyword", "graphlib", "sched", "io", "ast", "codecs", "email.utils", "logging",
    "platform", "traceback", "types", "xml.etree.ElementTree", "xml.sax.saxutils", "urllib.request",
    "dis", "doctest", "threading", "argparse", "configparser", "bz2", "lzma", "collections.abc", "numbers",
    "pickle", "weakref", "warnings", "zipfile", "wsgiref.util", "mimetypes", "hmac", "linecache", "tokenize",
    "plistlib", "unittest", "concurrent.futures",
)  # fmt: skip  (not `inspect`: torch.package replaces inspect.getfile once imported)

_VERBS = set(
    "return compute convert make create get set test find split join apply remove copy read write open format "
    "parse encode decode calculate check build construct generate insert delete change produce search match scan "
    "substitute escape unescape compile wrap fill dedent indent shorten sort merge push pop replace transform yield "
    "accumulate repeat filter group count decorate update load dump serialize deserialize normalize expand move "
    "rename compare strip pack unpack register raise determine locate extract add multiply divide subtract round "
    "quote unquote clear raise translate iterate collect choose shuffle perform emulate list walk guess map "
    "recursively truncate evaluate cache send reverse take drop".split()
)


def _conjugate(word: str) -> str:
    w = word.lower()
    if w.endswith(("s", "sh", "ch", "x", "z")):
        return w + "es"
    if w.endswith("y") and w[-2:-1] not in "aeiou":
        return w[:-1] + "ies"
    return w + "s"


def _first_paragraph(doc: str, name: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    para = re.sub(
        rf"^{re.escape(name)}\(.*?\)( -> [^.]*)?\.?\s*", "", para
    )  # C docstrings repeat the signature
    if para and para[-1] not in ".!?:":
        para += "."
    return para


# an object's default repr carries its memory address (`pat=<built-in method match of re.Pattern object at 0x7f..>`,
# one level of nested <...> as in `<function <lambda> at 0x..>`): it changes from process to process
_ADDRESS_REPR = re.compile(r"<(?:[^<>]|<[^<>]*>)*? at 0x[0-9a-fA-F]+>")


def _clean_signature(signature: str) -> str:
    """Drop the positional-only marker, which reads as noise in a request, and write defaults whose repr holds a
    memory address as ``...``, so that the requests (and the cache keys hashed from them) are the same in every
    process."""
    signature = _ADDRESS_REPR.sub("...", signature)
    return signature.replace(", /)", ")").replace("(/)", "()").replace(", /,", ",")


def _function_stub(head: str, para: str) -> str:
    """A ``def`` line plus a docstring: the shape of a "complete this function" request."""
    name_sig = head.strip("`")
    doc = textwrap.fill(para, width=72, initial_indent="    ", subsequent_indent="    ")
    return f'def {name_sig}:\n    """\n{doc}\n    """\n'


def _stdlib_request(
    index: int, module: str, head: str, para: str, kind: str, like: str | None = None, second: bool = False
) -> str:
    """Turn one docstring paragraph into a user request; a few phrasings, chosen by index, for variety.

    Two functions in three become a stub to complete (signature + docstring in a code block), the form of the
    common code benchmarks' prompts; the rest are written requests. ``index`` counts items of the same kind.
    ``second`` asks for the other form of the same function: the written request where the first was a stub, and
    the stub where it was written (a second answer by the target to the same task, in other words).
    """
    stub = kind == "function" and (index % 3 != 2) != second
    if stub:
        return f"Complete the following Python function.\n\n```python\n{_function_stub(head, para)}```"
    first, _, rest = para.partition(" ")
    if like is not None:
        body = f"Write a Python function {head} that behaves like `{like}`: {para}"
    elif kind == "function" and first.isalpha() and first[0].isupper() and first.lower() in _VERBS and rest:
        body = f"Write a Python function {head} that {_conjugate(first)} {rest}"
    else:
        body = f"Write a Python {kind} {head} as described here: {para}"
    if index % 4 == 1:
        body += f" Do not use `{like or module}`; implement it yourself."
    elif index % 4 == 3:
        body += " Include a docstring and a short usage example."
    return body


# classes whose public methods also become requests ("a function that behaves like str.title")
STDLIB_METHOD_CLASSES = (
    "builtins.str", "builtins.bytes", "builtins.list", "builtins.dict", "builtins.set", "builtins.int",
    "builtins.float", "collections.Counter", "collections.deque", "collections.OrderedDict", "datetime.date",
    "datetime.timedelta", "fractions.Fraction", "pathlib.PurePath", "string.Template", "difflib.SequenceMatcher",
    "textwrap.TextWrapper", "ipaddress.IPv4Network", "builtins.bytearray", "decimal.Decimal", "array.array",
    "io.StringIO", "io.BytesIO", "random.Random", "pathlib.Path", "re.Pattern", "zipfile.ZipFile",
    "collections.ChainMap", "statistics.NormalDist", "queue.Queue", "logging.Logger", "calendar.Calendar",
)  # fmt: skip


_METHOD_PARAMS = {
    "str": "s",
    "bytes": "data",
    "list": "items",
    "dict": "d",
    "set": "items",
    "int": "n",
    "float": "x",
}


class _Elided:
    def __repr__(self) -> str:
        return "..."


_LITERALS = (type(None), bool, int, float, complex, str, bytes)


def _constant_defaults(signature: inspect.Signature) -> inspect.Signature:
    """The signature with every default that is not a plain constant written ``...``: a list, a logger or a
    handler's repr shows the process's state (``logging.shutdown(handlerList=[...])`` grows with each handler)."""
    params = []
    for p in signature.parameters.values():
        d = p.default
        plain = isinstance(d, _LITERALS) or (isinstance(d, tuple) and all(isinstance(x, _LITERALS) for x in d))
        params.append(p if d is inspect.Parameter.empty or plain else p.replace(default=_Elided()))
    return signature.replace(parameters=params)


_STDLIB_TOP = frozenset(sys.stdlib_module_names) | {"builtins"}


def _documented(obj: Any, name: str) -> tuple[str, str] | None:
    """``(signature, first docstring paragraph)`` of a callable worth a request, else None (also for one that a
    third-party package put in the standard library's place: the requests must not depend on what was imported)."""
    home = getattr(obj, "__module__", None)
    if isinstance(home, str) and home.split(".")[0] not in _STDLIB_TOP:
        return None
    para = _first_paragraph(inspect.getdoc(obj) or "", name)
    if not 15 <= len(para) <= 500 or "deprecated" in para.lower():
        return None
    try:
        return _clean_signature(str(_constant_defaults(inspect.signature(obj)))), para
    except (TypeError, ValueError):  # builtins without introspectable signatures
        return None


def _module_requests(module_name: str) -> Iterator[tuple[str, str, str, str, str | None]]:
    """``(id, head, paragraph, kind, like)`` for the public functions and classes of one module."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # a stripped-down Python without e.g. zlib: just fewer prompts
        return
    for name in sorted(set(getattr(module, "__all__", None) or dir(module))):
        obj = getattr(module, name, None)
        if name.startswith("_") or not (
            inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)
        ):
            continue
        if inspect.isclass(obj) and (issubclass(obj, BaseException) or issubclass(obj, type)):
            continue
        found = _documented(obj, name)
        if found:
            kind = "class" if inspect.isclass(obj) else "function"
            yield f"{module_name}.{name}", f"`{name}{found[0]}`", found[1], kind, None


def _method_requests(qualname: str) -> Iterator[tuple[str, str, str, str, str | None]]:
    module_name, _, class_name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    label = "" if module_name == "builtins" else f"{module_name}."
    param = _METHOD_PARAMS.get(class_name, class_name.lower())
    for name in sorted(vars(cls)):
        obj = getattr(cls, name)
        if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
            continue
        found = _documented(obj, name)
        if not found or not found[0].startswith("(self"):
            continue  # static/class methods: no instance to pass
        signature = f"({param}" + found[0][len("(self") :]
        fname = f"{class_name.lower()}_{name}"
        yield (
            f"{qualname}.{name}",
            f"`{fname}{signature}`",
            found[1],
            "function",
            f"{label}{class_name}.{name}",
        )


def _module_group(module_name: str) -> list[tuple[str, str, str, str, str | None]]:
    """One module's requests, functions first."""
    return sorted(_module_requests(module_name), key=lambda r: r[3] != "function")


def _round_robin(groups: list[list[Any]]) -> list[Any]:
    """One item from each group in turn, so that any prefix of the result spans all groups."""
    out: list[Any] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


# the rest of the standard library, for budgets that want more than the modules above give; not the modules whose
# import has side effects (a browser, a printed poem, a display) or that are deprecated (PEP 594), nor the
# platform-specific ones that exist only on some machines, nor `inspect` (see above) or `sys`, whose hooks
# are whatever the running program (a test runner, a notebook) installed
_LEFT_OUT = frozenset(
    "inspect sys antigravity this idlelib tkinter turtle turtledemo lib2to3 ensurepip venv pydoc_data test distutils imp "
    "asynchat asyncore smtpd cgi cgitb crypt nntplib telnetlib sndhdr imghdr audioop chunk mailcap msilib nis "
    "ossaudiodev pipes spwd sunau uu xdrlib nt msvcrt winreg winsound readline curses posix ntpath nturl2path "
    "xxlimited xxsubtype".split()
)
STDLIB_MORE_PACKAGES = (
    "email.message", "email.headerregistry", "email.header", "email.charset", "email.parser", "email.policy",
    "http.client", "http.cookies", "http.cookiejar", "http.server", "importlib.util", "importlib.metadata",
    "importlib.resources", "json.decoder", "json.encoder", "logging.handlers", "logging.config",
    "multiprocessing.pool", "multiprocessing.shared_memory", "unittest.mock", "urllib.error", "urllib.response",
    "urllib.robotparser", "xml.dom.minidom", "xml.sax.handler", "xml.parsers.expat", "xmlrpc.client",
    "concurrent.futures.thread", "asyncio.locks", "asyncio.queues", "asyncio.tasks", "asyncio.streams",
    "sqlite3.dbapi2", "ctypes.util",
)  # fmt: skip


def stdlib_more_modules() -> list[str]:
    """The public standard-library modules not in :data:`STDLIB_MODULES`, in a fixed order."""
    top = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _LEFT_OUT)
    return [m for m in top + list(STDLIB_MORE_PACKAGES) if m not in STDLIB_MODULES]


def _phrase(rows: list[tuple[str, str, str, str, str | None]], seen: set[tuple], second: bool) -> list[tuple[str, str]]:
    """``(id, request)`` for the rows not in ``seen`` yet (which it extends); each kind numbered from 0."""
    items: list[tuple[str, str]] = []
    per_kind: dict[str, int] = {}
    for item_id, head, para, kind, like in rows:
        key = (head.split("(")[0], para, second)
        if key in seen or (second and kind != "function"):
            continue
        seen.add(key)
        module = item_id.rsplit(".", 1)[0]
        index = per_kind[kind] = per_kind.get(kind, -1) + 1
        request = _stdlib_request(index, module, head, para, kind, like, second)
        items.append((f"{item_id}#2" if second else item_id, request))
    return items


@functools.lru_cache(maxsize=1)
def stdlib_items() -> tuple[tuple[str, str], ...]:
    """``(id, request)`` pairs from the documented public callables of the standard library, deduplicated.

    First the modules and classes named above, interleaved, so that ``stdlib-code:N`` covers the whole list, not
    its first modules; these keep their order whatever is added after them. Then, for larger counts, the rest of
    the library's modules interleaved with a second request for every function, in the other form (the
    ``#2`` ids).
    """
    groups = [_module_group(m) for m in STDLIB_MODULES]
    groups += [list(_method_requests(c)) for c in STDLIB_METHOD_CLASSES]
    seen: set[tuple] = set()
    rows = _round_robin(groups)
    first = _phrase(rows, seen, second=False)
    more_rows = _round_robin([_module_group(m) for m in stdlib_more_modules()])
    more = _phrase(more_rows, seen, second=False)
    again = _phrase(rows + more_rows, seen, second=True)
    return tuple(first + _round_robin([more, again]))


def stdlib_code_prompts() -> list[list[Message]]:
    """Code-domain user requests built from standard-library docstrings; no answers (regenerate them)."""
    return [[{"role": "user", "content": request}] for _, request in stdlib_items()]
