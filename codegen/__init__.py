"""Codegen: kernel specs -> templates/*.cu.j2 -> CUDA source -> NVRTC -> CUBIN.

Submodules (import them directly; nothing heavy is imported here so that
`import codegen` stays cheap and works on machines without CUDA):

- `codegen.render`: the Jinja2 environment, generated-file headers, kernel names.
- `codegen.nvrtc`:  NVRTC compilation to CUBIN for a target architecture.
- `codegen.cache`:  the content-addressed bundle cache (store and verify only).
"""
