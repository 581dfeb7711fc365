#!/bin/sh
# The system tools the daemon runs, installed with apt when missing (make setup, .ci/run):
# poppler-utils (pdftotext, pdftoppm, pdfinfo) reads PDFs and renders scanned pages;
# tesseract-ocr and tesseract-ocr-eng read scanned pages for models without vision;
# ffmpeg (ffmpeg, ffprobe) runs the file operations on videos (fileops/).
# More OCR languages: tesseract-ocr-LANG (e.g. tesseract-ocr-deu), with ocr_languages.
set -eu
missing=""
for tool in pdftotext pdftoppm pdfinfo; do
  command -v "$tool" >/dev/null || { missing="poppler-utils"; break; }
done
command -v tesseract >/dev/null || missing="$missing tesseract-ocr"
{ command -v ffmpeg >/dev/null && command -v ffprobe >/dev/null; } || missing="$missing ffmpeg"
if ! command -v tesseract >/dev/null || ! tesseract --list-langs 2>/dev/null | grep -qx eng; then
  missing="$missing tesseract-ocr-eng"
fi
[ -z "$missing" ] && exit 0
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq $missing
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
  sudo apt-get install -y $missing
else
  echo "note: install$missing for PDF pages, OCR and video operations (the daemon runs without them)"
fi
