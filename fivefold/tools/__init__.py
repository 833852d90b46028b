"""Tools built on the runtime: parity and diagnosis of a layout against the single-process run
(`parity`, `parity_cli`, `diagnose`), the dry run (`dryrun`), run reports and step timelines
(`report`, `timeline`), benchmarks (`bench`), Hugging Face folders (`hf`), text generation
(`generate`), measured saved activations (`saved_activations`) and the multi-process test
harness (`testing`). They sit in the top layer beside the run (docs/architecture.md): the
loop, the composition point, the strategies and the model never import them.
"""
