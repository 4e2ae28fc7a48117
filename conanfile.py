"""Conan 2 recipe for mpzero's header-only core (the CMake target mpzero::mpzero).

    conan create . --build=missing          # package this checkout into the local cache

The package holds what `cmake --install` installs: the headers under include/ and
mpzero's own CMake package (lib/cmake/mpzero: mpzeroConfig.cmake and its targets),
whose mpzero::mpzero carries C++20, the compile options the library relies on
(-ffp-contract=off -fno-math-errno with GCC and Clang) and OpenMP when the build found
it. A consumer's CMakeToolchain puts the package on CMAKE_PREFIX_PATH, so
find_package(mpzero) loads that file, the same one a plain install gives. The LibTorch
engine (mpzero::torch) is not part of this package: build it from source
(docs/torch.md).

The version is read from include/mpzero/config.hpp, where it is written once.
"""
import os
import re

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load


class MpzeroConan(ConanFile):
    name = "mpzero"
    package_type = "header-library"
    description = "Mixed-precision ZeRO optimizers as a header-only C++20/CUDA template library"
    license = "MIT"
    topics = ("deep-learning", "optimizer", "mixed-precision", "zero", "cuda", "header-only")
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "CMakeLists.txt", "cmake/*", "include/*", "LICENSE"
    no_copy_source = True

    def set_version(self):
        header = load(self, os.path.join(self.recipe_folder, "include", "mpzero", "config.hpp"))
        parts = []
        for part in ("MAJOR", "MINOR", "PATCH"):
            m = re.search(r"^#define MPZERO_VERSION_%s +([0-9]+)$" % part, header, re.MULTILINE)
            if not m:
                raise ValueError("include/mpzero/config.hpp does not define MPZERO_VERSION_%s" % part)
            parts.append(m.group(1))
        self.version = ".".join(parts)

    def layout(self):
        cmake_layout(self)

    def package_id(self):
        # Headers only: one package serves every configuration.
        self.info.clear()

    def generate(self):
        tc = CMakeToolchain(self)
        # The core alone: no tests, benchmarks, examples, LibTorch adapter or CUDA
        # targets, so configuring needs nothing beyond CMake and a C++ compiler.
        tc.cache_variables["MPZERO_BUILD_TESTS"] = False
        tc.cache_variables["MPZERO_BUILD_BENCH"] = False
        tc.cache_variables["MPZERO_BUILD_EXAMPLES"] = False
        tc.cache_variables["MPZERO_BUILD_TORCH"] = False
        tc.cache_variables["MPZERO_ENABLE_CUDA"] = False
        tc.cache_variables["MPZERO_INSTALL"] = True
        tc.cache_variables["CMAKE_INSTALL_LIBDIR"] = "lib"
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        copy(self, "LICENSE", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))
        cmake = CMake(self)
        cmake.install()

    def package_info(self):
        # CMake consumers use the package's own mpzeroConfig.cmake (found through the
        # package folder on CMAKE_PREFIX_PATH), which defines mpzero::mpzero.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.set_property("cmake_file_name", "mpzero")
        self.cpp_info.set_property("cmake_target_name", "mpzero::mpzero")
        self.cpp_info.builddirs = [os.path.join("lib", "cmake", "mpzero")]
        # For other generators (pkg-config, Meson, ...): the headers and the options
        # mpzero::mpzero carries. C++20 is the consumer's to set (compiler.cppstd).
        self.cpp_info.includedirs = ["include"]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        if self.settings.get_safe("compiler") in ("gcc", "clang", "apple-clang"):
            self.cpp_info.cxxflags = ["-ffp-contract=off", "-fno-math-errno"]
