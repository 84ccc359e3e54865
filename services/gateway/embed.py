#!/usr/bin/env python3
"""Writes a C file holding one file's bytes as a string, so the gateway
serves its playground page (playground.html) from the binary, with no file
to install beside it.

usage: embed.py INPUT OUTPUT SYMBOL
defines: const char SYMBOL[]; const unsigned long SYMBOL_len;"""
import sys


def main():
    src, out, sym = sys.argv[1:4]
    data = open(src, "rb").read()
    lines = []
    for i in range(0, len(data), 64):
        chunk = data[i:i + 64]
        lines.append('    "' + "".join(f"\\x{b:02x}" for b in chunk) + '"')
    with open(out, "w") as f:
        f.write(f"/* Generated from {src.split('/')[-1]} by embed.py; do not edit. */\n")
        f.write(f"const char {sym}[] =\n" + "\n".join(lines or ['    ""']) + ";\n")
        f.write(f"const unsigned long {sym}_len = {len(data)}ul;\n")


if __name__ == "__main__":
    main()
