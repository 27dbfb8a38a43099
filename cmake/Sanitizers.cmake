# Sanitizer and fuzzing instrumentation for the whole build (docs/reliability.md).
#
#   DIMATTN_SANITIZE  ""                  (default) none
#                     "address,undefined" ASan + UBSan, every target
#                     "thread"            TSan, every target (use with DIMATTN_WITH_TORCH=OFF:
#                                         LibTorch is not instrumented, so its threads would
#                                         hide races and report false ones)
#   DIMATTN_FUZZ      ON: clang only; every target gets libFuzzer's coverage
#                     instrumentation (-fsanitize=fuzzer-no-link) but the test suites'
#                     sources and the standard library's and Eigen's internals
#                     (tests/fuzz/coverage_ignorelist.txt), the kernels without traced
#                     comparisons (kernels/CMakeLists.txt); tests/fuzz builds its
#                     targets (-fsanitize=fuzzer). Combine with address,undefined.
#
# Included from the top-level CMakeLists.txt after the options and before any
# target, so that add_compile_options reaches every target, the library included:
# a sanitizer that skips the library misses exactly the bugs it is for.
set(DIMATTN_SANITIZE "" CACHE STRING "Sanitizers for every target: empty, address,undefined, or thread")
option(DIMATTN_FUZZ "Build libFuzzer targets (tests/fuzz); clang only" OFF)

if(DIMATTN_SANITIZE)
  string(REPLACE "," ";" _dimattn_san_list "${DIMATTN_SANITIZE}")
  foreach(_s IN LISTS _dimattn_san_list)
    if(NOT _s MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "DIMATTN_SANITIZE: unknown sanitizer '${_s}' (use address,undefined or thread)")
    endif()
  endforeach()
  if("thread" IN_LIST _dimattn_san_list AND "address" IN_LIST _dimattn_san_list)
    message(FATAL_ERROR "DIMATTN_SANITIZE: thread and address cannot be combined; use two build folders")
  endif()
  if("thread" IN_LIST _dimattn_san_list AND DIMATTN_WITH_TORCH)
    message(WARNING "DIMATTN_SANITIZE=thread with DIMATTN_WITH_TORCH=ON: LibTorch is not instrumented; "
                    "TSan results over the torch backend are not meaningful. Use -DDIMATTN_WITH_TORCH=OFF.")
  endif()
  # Frame pointers and line tables for usable stacks. ASan and TSan report
  # with a non-zero exit code by default (LeakSanitizer included), which ctest
  # counts as a failure; no environment is needed (docs/reliability.md).
  # C++ only: nvcc takes none of these (the presets build without CUDA).
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${DIMATTN_SANITIZE};-fno-omit-frame-pointer;-g1>")
  add_link_options(-fsanitize=${DIMATTN_SANITIZE})
  if("undefined" IN_LIST _dimattn_san_list)
    # Abort on the first finding so that ctest counts it as a failure (UBSan
    # otherwise prints and continues). float-divide-by-zero stays off, as in
    # "undefined" itself: IEEE inf/NaN are intended results (masked softmax rows).
    add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=undefined>")
    add_link_options(-fno-sanitize-recover=undefined)
  endif()
  message(STATUS "dimattn: sanitizers ${DIMATTN_SANITIZE}")
endif()

if(DIMATTN_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "DIMATTN_FUZZ needs clang (libFuzzer); configure with -DCMAKE_CXX_COMPILER=clang++ "
                        "or use the 'asan-eigen' preset")
  endif()
  # Coverage skips the standard library's and Eigen's internals
  # (tests/fuzz/coverage_ignorelist.txt). The list is passed as a copy whose
  # name holds its hash: neither ninja nor ccache reads the file, and a
  # changed list must change the command line to rebuild everything.
  set(_dimattn_ignorelist "${CMAKE_CURRENT_LIST_DIR}/../tests/fuzz/coverage_ignorelist.txt")
  file(MD5 "${_dimattn_ignorelist}" _dimattn_ignorelist_md5)
  set(_dimattn_ignorelist_copy "${CMAKE_BINARY_DIR}/coverage_ignorelist-${_dimattn_ignorelist_md5}.txt")
  configure_file("${_dimattn_ignorelist}" "${_dimattn_ignorelist_copy}" COPYONLY)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>"
    "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize-coverage-ignorelist=${_dimattn_ignorelist_copy}>")
  message(STATUS "dimattn: libFuzzer coverage instrumentation on")
endif()
