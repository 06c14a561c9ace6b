// Validates monitoring.coreos.com/v1 objects (a JSON list on stdin) with the validators that
// @kubernetes-models/prometheus-operator generates from the Prometheus Operator's CRD schemas.
// argv[2]: the node_modules folder holding that package. Prints a JSON list of problems.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const objects = JSON.parse(readFileSync(0, "utf8"));
const problems = [];
for (const obj of objects) {
  const where = `${obj.kind}/${obj.metadata?.name}`;
  if (obj.apiVersion !== "monitoring.coreos.com/v1") {
    problems.push(`${where}: apiVersion ${obj.apiVersion} is not monitoring.coreos.com/v1`);
    continue;
  }
  const file = join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", `${obj.kind}.js`);
  let model;
  try {
    model = await import(pathToFileURL(file).href);
  } catch (err) {
    problems.push(`${where}: unknown kind (${err.message})`);
    continue;
  }
  try {
    new model[obj.kind](obj).validate();
  } catch (err) {
    problems.push(`${where}: ${err.message}`);
  }
}
process.stdout.write(JSON.stringify(problems));
