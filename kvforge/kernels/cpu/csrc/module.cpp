// The Python module that loading a build imports (kernels/cpu/extension.py). It has no functions of its own: loading
// it runs the TORCH_LIBRARY registrations of the generated bindings.cpp (builds.py), which make the ops
// torch.ops.kvforge_cpu.*.
//
// NOTE: plain CPython rather than pybind11 (PYBIND11_MODULE) or torch/extension.h, as no file here includes them:
// those headers took half of each file's compile time (the 12 files of one build, -O3, one core: 241 -> 115 s).
#include <Python.h>

#define KVFORGE_STRING(name) #name
#define KVFORGE_NAME(name) KVFORGE_STRING(name)
#define KVFORGE_INIT(name) KVFORGE_CONCAT(PyInit_, name)
#define KVFORGE_CONCAT(a, b) a##b

static PyModuleDef kvforge_module = {PyModuleDef_HEAD_INIT, KVFORGE_NAME(TORCH_EXTENSION_NAME),
                                     "kvforge's C++ CPU kernels (torch.ops.kvforge_cpu)", 0, nullptr};

PyMODINIT_FUNC KVFORGE_INIT(TORCH_EXTENSION_NAME)() { return PyModuleDef_Init(&kvforge_module); }
