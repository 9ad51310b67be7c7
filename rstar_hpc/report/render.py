"""report.md and report.html from one document: a list of blocks, so the two never disagree.

    ("h1" | "h2", text)    ("p", text)    ("list", [items])    ("table", header, rows)    ("figure", png, caption)
The HTML references the PNGs beside it (one folder holds the report: copy it whole); it needs no network.
"""
from __future__ import annotations

import html

Block = tuple


def to_markdown(doc: list[Block]) -> str:
    out = []
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2"):
            out += [f"{'#' if kind == 'h1' else '##'} {block[1]}", ""]
        elif kind == "p":
            out += [block[1], ""]
        elif kind == "list":
            out += [f"- {item}" for item in block[1]] + [""]
        elif kind == "table":
            header, rows = block[1], block[2]
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows] + [""]
        elif kind == "figure":
            out += [f"![{block[2]}]({block[1]})", "", f"*{block[2]}*", ""]
    return "\n".join(out)


STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
         "td:first-child,th:first-child{text-align:left}figure{margin:1.5em 0}img{max-width:100%}"
         "figcaption{color:#555;font-size:0.9em}")


def to_html(doc: list[Block], title: str) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{e(title)}</title>",
           f"<style>{STYLE}</style></head><body>"]
    for block in doc:
        kind = block[0]
        if kind in ("h1", "h2"):
            out.append(f"<{kind}>{e(block[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{e(block[1])}</p>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{e(str(i))}</li>" for i in block[1]) + "</ul>")
        elif kind == "table":
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in block[1]) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in block[2]]
            out.append("</table>")
        elif kind == "figure":
            out.append(f"<figure><img src='{e(block[1])}' alt='{e(block[2])}'>"
                       f"<figcaption>{e(block[2])}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
