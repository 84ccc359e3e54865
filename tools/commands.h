/* The `kiln` CLI commands.  Each lives in its own tools/cmd_<name>.c and
 * returns a process exit status (0 ok, 1 runtime failure, 2 usage error).
 * Errors are printed to stderr as "kiln <command>: message". */
#ifndef KILN_TOOLS_COMMANDS_H
#define KILN_TOOLS_COMMANDS_H

typedef struct kiln_command {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv); /* argv[0] is the command name */
} kiln_command;

int kiln_cmd_make_checkpoint(int argc, char **argv);
int kiln_cmd_generate(int argc, char **argv);
int kiln_cmd_edit(int argc, char **argv);
int kiln_cmd_tokenize(int argc, char **argv);
int kiln_cmd_encode(int argc, char **argv);
int kiln_cmd_serve(int argc, char **argv);
int kiln_cmd_keygen(int argc, char **argv);

/* The table, terminated by a zeroed entry (tools/kiln.c). */
extern const kiln_command kiln_commands[];

#endif
