#!/usr/bin/env bash
# Compiles the hand-written GLSL kernels of the raw Vulkan backend (shaders/vulkan/*.comp)
# to the SPIR-V files committed beside them, so that users build Kiln without a shader
# compiler. Needs glslangValidator (Debian/Ubuntu: glslang-tools, installed by
# scripts/setup.sh). tests/vk_shaders.rs fails when a committed .spv is stale.
set -euo pipefail
cd "$(dirname "$0")/../shaders/vulkan"
for src in *.comp; do
    glslangValidator -V --target-env vulkan1.2 -o "${src%.comp}.spv" "$src" >/dev/null
    echo "compiled $src -> ${src%.comp}.spv"
done
