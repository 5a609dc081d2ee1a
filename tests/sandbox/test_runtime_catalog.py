"""Every library and command the gateway documents promise works in a real sandbox.

Each one gets a small real task, run as the sandbox user with no network:
imports, a PDF made by pdfkit and read back by pdf2image, a table read by
tabula, archives handled by unzip, unrar, 7z and 7zip, a file found by fd. The
catalog (``GET /v1/runtime``, docs/runtime.md) is checked against the pinned
lists it is generated from.
"""

from __future__ import annotations

import struct
import textwrap
import zlib
from pathlib import Path

import pytest

from shoal.sandbox import catalog
from shoal.sandbox.runtime import COMMAND_LINKS, PROJECT_ROOT, python_version

WORKSPACE = "/home/agent/workspace"


def _block(head_type: int, flags: int, body: bytes) -> bytes:
    header = struct.pack("<BHH", head_type, flags, 7 + len(body)) + body
    return struct.pack("<H", zlib.crc32(header) & 0xFFFF) + header


def rar4(files: dict[str, bytes]) -> bytes:
    """A RAR 4 archive of stored (uncompressed) files, written by hand: creating
    RAR archives takes the non-free `rar`, reading them is what the sandbox offers."""
    archive = b"Rar!\x1a\x07\x00" + _block(0x73, 0, b"\x00" * 6)
    for name, data in files.items():
        raw = name.encode()
        body = struct.pack("<IIBIIBBHI", len(data), len(data), 3, zlib.crc32(data),
                           0x5A210000, 20, 0x30, len(raw), 0x81A4) + raw
        archive += _block(0x74, 0x8000, body) + data
    return archive + _block(0x7B, 0x4000, b"")


async def python(sandbox, code: str, timeout: float = 60) -> str:
    result = await sandbox.run_python(textwrap.dedent(code), timeout=timeout)
    assert result.return_code == 0, result.stderr[-3000:]
    return result.stdout


async def bash(sandbox, command: str, timeout: float = 60) -> str:
    result = await sandbox.run_bash(command, timeout=timeout)
    assert result.return_code == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
    return result.stdout


# -- the catalog agrees with the pinned lists -------------------------------------------------------
def test_the_runtime_page_is_generated_from_the_pinned_lists():
    page = (PROJECT_ROOT / "docs" / "runtime.md").read_text()
    assert page == catalog.page(python_version()), (
        "docs/runtime.md is stale: run `shoal runtime page > docs/runtime.md`")


def test_every_promised_library_is_pinned_and_every_tool_is_packaged():
    pinned = {library.name for library in catalog.libraries()}
    assert set(catalog.PROMISED) - pinned == set()
    listed = set(catalog.packages("base")) | set(catalog.packages("documents"))
    for tool in catalog.TOOLS:
        if tool.host_command is not None:
            assert tool.package in listed, f"{tool.command}: {tool.package} is in no package list"
    for name, target in COMMAND_LINKS.items():
        assert any(tool.command == name and tool.host_command == Path(target).name
                   for tool in catalog.TOOLS), name


# -- libraries --------------------------------------------------------------------------------------
async def test_every_promised_library_imports(sandbox):
    names = sorted({catalog.Library(name, "").import_name for name in catalog.PROMISED})
    # A few per interpreter: all of them at once outgrow these test sandboxes' memory.
    out = await python(sandbox, f"""
        import subprocess, sys
        names = {names!r}
        for start in range(0, len(names), 8):
            batch = names[start:start + 8]
            subprocess.run([sys.executable, "-c", "import " + ", ".join(batch)], check=True)
        print(len(names))
    """, timeout=300)
    assert out == f"{len(names)}\n"


async def test_documents_are_made_converted_and_read_back(sandbox):
    out = await python(sandbox, """
        import io, pdfkit, img2pdf, tabula, fpdf, pdf2image, pypdf
        from PIL import Image

        # HTML to PDF through wkhtmltopdf, then back to an image through poppler.
        html = "<h1>Quarterly</h1><table border=1><tr><th>region</th><th>sales</th></tr>" \\
               "<tr><td>north</td><td>120</td></tr><tr><td>south</td><td>80</td></tr></table>"
        pdfkit.from_string(html, "report.pdf", options={"quiet": ""})
        pages = pdf2image.convert_from_path("report.pdf", dpi=50)
        print("pages", len(pages), pages[0].size[0] > 100)

        # tabula (Java) finds the table in it.
        tables = tabula.read_pdf("report.pdf", pages=1, lattice=True, silent=True)
        cells = {str(cell).strip() for frame in tables for row in frame.itertuples()
                 for cell in row[1:]} | {str(c) for frame in tables for c in frame.columns}
        print("table", {"region", "sales", "north", "120", "south", "80"} <= cells)

        # An image to PDF, losslessly; fpdf2 writes one from scratch.
        Image.new("RGB", (64, 32), "navy").save("tile.png")
        with open("tile.pdf", "wb") as handle:
            handle.write(img2pdf.convert("tile.png"))
        doc = fpdf.FPDF()
        doc.add_page()
        doc.set_font("helvetica", size=12)
        doc.cell(text="made by fpdf2")
        doc.output("fpdf.pdf")
        print("read", pypdf.PdfReader("fpdf.pdf").pages[0].extract_text().strip(),
              len(pypdf.PdfReader("tile.pdf").pages))
    """, timeout=120)
    assert out.splitlines() == ["pages 1 True", "table True",
                                "read made by fpdf2 1"], out


async def test_the_http_clients_shape_requests_offline(sandbox):
    out = await python(sandbox, """
        import requests, httpx, anthropic, openai
        prepared = requests.Request("POST", "http://example.invalid/v1", json={"a": 1}).prepare()
        print(prepared.headers["Content-Type"], prepared.body)
        print(httpx.Request("GET", "http://example.invalid/x", params={"q": "1"}).url)
        print(type(anthropic.Anthropic(api_key="k", base_url="http://127.0.0.1:9")).__name__,
              type(openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9")).__name__)
        try:
            requests.get("http://93.184.216.34/", timeout=5)
        except requests.exceptions.ConnectionError:
            print("no network")
    """)
    assert out.splitlines() == ['application/json b\'{"a": 1}\'',
                                "http://example.invalid/x?q=1", "Anthropic OpenAI",
                                "no network"], out


# -- commands ---------------------------------------------------------------------------------------
async def test_archives_open_with_every_named_tool(sandbox):
    archive = rar4({"hello.txt": b"hello from rar\n", "dir/b.txt": b"bee\n"})
    await python(sandbox, f"""
        import zipfile
        open("t.rar", "wb").write({archive!r})
        with zipfile.ZipFile("t.zip", "w") as z:
            z.writestr("zipped.txt", "from zip\\n")
    """)
    out = await bash(sandbox, """
        set -e
        unzip -o -q t.zip -d z && cat z/zipped.txt
        unrar l t.rar | grep -c '\\.txt'
        mkdir -p r && cd r && unrar x ../t.rar > /dev/null && cat hello.txt dir/b.txt && cd ..
        printf 'seven\\n' > s.txt
        7z a -bd -bso0 s.7z s.txt && 7zip x -y -bso0 -oout s.7z && cat out/s.txt
        7zip a -bso0 t2.7z z/zipped.txt && 7z l t2.7z | grep -c zipped.txt
    """)
    assert out.splitlines() == ["from zip", "2", "hello from rar", "bee", "seven", "1"], out


async def test_search_query_and_calculate(sandbox):
    out = await bash(sandbox, """
        set -e
        mkdir -p deep/er && printf 'needle here\\n' > deep/er/haystack.md
        fd haystack . | sed 's|^\\./||'
        rg -l needle . | sed 's|^\\./||'
        echo '2^100' | bc
        sqlite3 db.sqlite "create table t(x); insert into t values (2),(3); select sum(x) from t;"
        echo '{"a": [1, 2, 3]}' | jq '.a | add'
        node -e 'console.log([1, 2, 3].map(x => x * 2).join(","))'
        pdftotext -v 2>&1 | head -1 | cut -d' ' -f1
    """)
    assert out.splitlines() == ["deep/er/haystack.md", "deep/er/haystack.md",
                                "1267650600228229401496703205376", "5", "6", "2,4,6",
                                "pdftotext"], out


async def test_javascript_runs_on_the_pinned_bun(sandbox):
    result = await sandbox.run_javascript(
        "console.log(typeof fetch, Bun.version, [1, 2].map(x => x + 1).join(' '))")
    assert result.return_code == 0, result.stderr
    assert result.stdout == f"function {catalog.bun_version()} 2 3\n"


def test_the_catalog_reports_what_this_host_has():
    described = catalog.describe(python_version())
    missing = [tool["command"] for tool in described["tools"] if not tool["available"]]
    assert missing == [], missing
    assert described["python"]["version"] == python_version()


@pytest.mark.parametrize("tool", [tool for tool in catalog.TOOLS if tool.host_command])
def test_a_missing_command_is_reported_unavailable(tool):
    described = catalog.describe("3", available=lambda command: None)
    entry = next(item for item in described["tools"] if item["command"] == tool.command)
    assert entry["available"] is False
