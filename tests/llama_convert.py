"""llama.cpp's own converter (convert_hf_to_gguf.py, from the llama-cpp-python sdist on the registry), run on a tiny
random checkpoint: `python llama_convert.py LLAMA_CPP_DIR HF_FOLDER --outfile F --outtype q8_0 --no-mtp`.

The converter names a tokenizer by a hash of how it splits a test text and refuses one it does not know; the tiny
checkpoints' trained tokenizer is no published model's, so it is told the pre-tokenizer is qwen2's (tfq rebuilds
the tokenizer from the file's metadata either way). Nothing else of the converter is changed."""
import runpy
import sys

root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
from conversion import base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
