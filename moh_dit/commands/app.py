"""moh-dit app: sample a model in the browser at any head activation ratio.

    pip install gradio                        # once
    moh-dit app --model demo_output/run       # then open http://127.0.0.1:7860
"""

from __future__ import annotations

import argparse

from . import int_range

DESCRIPTION = "a local web page: sample at any head activation ratio, with the head usage beside the images"


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a pipeline folder, a run folder or a transformer folder")
    parser.add_argument("--vae", help="AutoencoderKL path or Hub id, or 'none' (default: the pipeline's own)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every network)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also a temporary public link through Gradio")
    parser.add_argument("--max-images", type=int_range(1, 256), default=16, help="images a request (default: 16)")
    parser.add_argument("--max-steps", type=int_range(1, 1000), default=250, help="steps a request (default: 250)")


def main(args: argparse.Namespace) -> None:
    import os
    import signal
    import tempfile
    from pathlib import Path

    import torch

    from moh_dit.app import build_app
    from moh_dit.sampling import load_pipeline

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = load_pipeline(args.model, vae=args.vae).to(device)
    pipe.set_progress_bar_config(disable=True)
    with tempfile.TemporaryDirectory(prefix="moh-dit-app-") as cache:
        os.environ["GRADIO_TEMP_DIR"] = cache  # the images Gradio serves: removed with the server
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
        demo = build_app(pipe, title=Path(args.model).resolve().name, max_images=args.max_images,
                         max_steps=args.max_steps)
        print(f"serving on http://{args.host}:{args.port} (Ctrl-C to stop)", flush=True)
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, quiet=True)
