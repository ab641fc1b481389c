"""The training text of K3-nano (tools/train_nano.py): the Python 3.11 standard
library's own documentation as installed by Debian (python3.11 /
libpython3.11-stdlib, PSF License Version 2; /usr/share/doc/python3.11/copyright).

  * topics: the language reference topics of /usr/lib/python3.11/pydoc_data/topics.py
    (the text `help("assert")` prints), one document per topic;
  * docstrings: the module, class and function docstrings of the pure-Python
    standard library under /usr/lib/python3.11 (parsed with `ast`, never
    imported; tests, idlelib, lib2to3 fixers, site-packages excluded), one
    document per module with its classes and functions as "name(args)" heads,
    its first MODULE_CHARS characters;
  * chat: question/answer turns in the K3 XTML chat format (SPEC §5.4) made from
    the same docstrings ("What does json.dumps do?" -> the docstring's first
    paragraph) and topics ("Explain the assert statement." -> its first
    paragraphs), so the chat path answers in the format `shoal serve` prompts.

Deterministic: files in sorted order, no randomness; a document is held out for
evaluation when sha256(its name) mod 20 == 0 (5%).
"""
import ast
import hashlib
import os
import re
import runpy

ROOT = "/usr/lib/python3.11"
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "ensurepip",
             "turtledemo", "tkinter", "config-3.11-x86_64-linux-gnu", "pydoc_data", "encodings"}
SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py"}


def held_out(name):
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 20 == 0


def sources():
    """The files read, in order (the data list)."""
    files = [os.path.join(ROOT, "pydoc_data", "topics.py")]
    for d, dirs, fs in os.walk(ROOT):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("_"))
        for f in sorted(fs):
            if f.endswith(".py") and f not in SKIP_FILES and not f.startswith("test_"):
                files.append(os.path.join(d, f))
    return files


def clean(doc):
    import inspect
    doc = inspect.cleandoc(doc)
    return doc.replace("\t", "    ").strip()


def first_paragraph(doc, limit=600):
    paras = [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]
    out = ""
    for p in paras:
        if out and len(out) + len(p) > limit:
            break
        out = (out + "\n\n" + p) if out else p
        if len(out) > limit // 2:
            break
    return out


def signature(fn):
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return "(" + ", ".join(names) + ")"


def module_docs(path):
    """(module name, document text, [(qualified name, first paragraph)])."""
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    mod = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError):
        return mod, "", []
    parts, qa = [], []
    md = ast.get_docstring(tree, clean=False)
    if md:
        parts.append(f"Module {mod}\n\n{clean(md)}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node, clean=False)
            if isinstance(node, ast.FunctionDef):
                head = f"{mod}.{node.name}{signature(node)}"
            else:
                head = f"class {mod}.{node.name}"
            if doc:
                d = clean(doc)
                parts.append(f"{head}\n\n{d}")
                qa.append((f"{mod}.{node.name}", first_paragraph(d)))
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                        sd = ast.get_docstring(sub, clean=False)
                        if sd:
                            d = clean(sd)
                            parts.append(f"{mod}.{node.name}.{sub.name}{signature(sub)}\n\n{d}")
                            qa.append((f"{mod}.{node.name}.{sub.name}", first_paragraph(d)))
    return mod, "\n\n\n".join(parts), qa


def topic_docs(path):
    t = runpy.run_path(path)["topics"]
    out = []
    for k in sorted(t):
        text = t[k].strip()
        title = text.split("\n", 1)[0].strip()
        out.append((k, title, text))
    return out


MODULE_CHARS = 4000  # the head of each module's docstring document (the budget of a CPU run)
QUESTIONS = ["What does {} do?", "What is {}?", "Explain {}.", "Tell me about {}.", "How do I use {}?"]


def documents(module_chars=MODULE_CHARS):
    """[(name, kind, payload)]: kind 'text' (payload str) or 'chat' (payload (question, answer)).
    module_chars=None: whole module documents (the vocabulary's text)."""
    files = sources()
    docs = []
    for k, title, text in topic_docs(files[0]):
        docs.append(("topic:" + k, "text", text))
        q = QUESTIONS[len(k) % len(QUESTIONS)].format(title[0].lower() + title[1:] if title[:4] == "The " else title)
        docs.append(("chat-topic:" + k, "chat", (q, first_paragraph(text.split("\n", 2)[-1].strip(), 700))))
    for path in files[1:]:
        mod, text, qa = module_docs(path)
        if text:
            docs.append(("module:" + mod, "text", text[:module_chars]))
        for i, (name, ans) in enumerate(qa):
            if len(ans) < 40:
                continue
            q = QUESTIONS[i % len(QUESTIONS)].format(name)
            docs.append(("chat:" + name, "chat", (q, ans)))
    return docs


def data_list():
    """The licence and the files, for the model's README."""
    return ("Python 3.11 standard library documentation as installed by Debian bookworm "
            "(packages libpython3.11-minimal, libpython3.11-stdlib; PSF License Version 2, "
            "/usr/share/doc/python3.11/copyright)", [os.path.relpath(p, ROOT) for p in sources()])
