# Installs mixprec from BINARY_DIR into a scratch prefix, then configures,
# builds and runs a downstream project that finds it with find_package(mixprec).
set(prefix ${BINARY_DIR}/find_package_test/prefix)
set(build ${BINARY_DIR}/find_package_test/build)
file(REMOVE_RECURSE ${prefix} ${build})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix}
                COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/find_package/project -B ${build}
                        -G ${GENERATOR} "-DCMAKE_PREFIX_PATH=${prefix};${TORCH_PREFIX}"
                COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${build} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${build}/downstream COMMAND_ERROR_IS_FATAL ANY)
