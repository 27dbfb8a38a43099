# ctest driver: cmake --install into a scratch prefix, then configure, build
# and run tests/consumer against it with find_package(dimattn).
set(prefix ${BUILD_DIR}/consumer-install)
set(cbuild ${BUILD_DIR}/consumer-build)
file(REMOVE_RECURSE ${prefix} ${cbuild})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${cbuild} -G ${GENERATOR} "-DCMAKE_PREFIX_PATH=${prefix}")
run(${CMAKE_COMMAND} --build ${cbuild})
run(${cbuild}/consumer)
# The installed command-line tool starts and runs a call (its run path finds
# libdimattn and LibTorch without LD_LIBRARY_PATH).
run(${prefix}/bin/dimattn explain --seq-q 16)
